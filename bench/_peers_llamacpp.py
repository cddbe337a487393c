"""Peer side of bench/quality.py, bench/tps.py and bench/structured.py: quantize a GGUF, dump a GGUF's logits over
given token ids (llama.cpp) or an onnxruntime-genai model's, tokenize a text with a GGUF's tokenizer, or compile
JSON schemas to llama.cpp grammars and generate with them.

Runs only in the peer venv (.venv-peers, built by bench/setup_peers) so that the product venv never
imports llama_cpp or onnxruntime_genai; bench/quality.py calls it as a subprocess and reads back the files it
writes. It imports nothing from the product, only the peer packages and numpy.

Run: .venv-peers/bin/python bench/_peers_llamacpp.py quantize F32.gguf OUT.gguf Q4_K_M [--threads 2]
     .venv-peers/bin/python bench/_peers_llamacpp.py logits MODEL.gguf IDS.npy OUT.npy [--threads 2]
     .venv-peers/bin/python bench/_peers_llamacpp.py tokenize MODEL.gguf TEXT.txt OUT.npy
     .venv-peers/bin/python bench/_peers_llamacpp.py genai-logits GENAI_DIR IDS.npy OUT.npy [--threads 2]
     .venv-peers/bin/python bench/_peers_llamacpp.py json-schemas MODEL.gguf JOB.json OUT.json [--threads 2]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys

import llama_cpp
import numpy as np

# n_batch / n_ubatch: llama.cpp evaluates the ids in chunks of this many tokens, one KV cache across
# chunks, like quantize.evaluate.CHUNK_TOKENS (256) does for the ONNX graphs.
CHUNK_TOKENS = 256
GENAI_MIN_LENGTH = 1024
SCHEMA_CONTEXT_TOKENS = 2048  # json-schemas: a prompt plus the job's max_tokens


def quantize(src: str, dst: str, ftype_name: str, threads: int) -> dict:
    """llama_model_quantize src -> dst with llama.cpp's default mix for ftype_name (e.g. "Q4_K_M")."""
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}", None)
    if ftype is None:
        raise SystemExit(f"unknown llama.cpp ftype {ftype_name!r} (no llama_cpp.LLAMA_FTYPE_MOSTLY_{ftype_name})")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src}, {ftype_name}) failed with code {rc}")
    return {"size_bytes": os.path.getsize(dst)}


def logits(model: str, ids_path: str, out: str, threads: int) -> dict:
    """Full-vocabulary logits float32 [T, V] of `model` at every position of the ids, saved to out."""
    ids = np.load(ids_path).astype(np.int64).tolist()
    n_ctx = -(-len(ids) // CHUNK_TOKENS) * CHUNK_TOKENS  # a whole number of chunks, >= len(ids)
    llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_batch=CHUNK_TOKENS, n_ubatch=CHUNK_TOKENS, logits_all=True,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    if llm.n_vocab() != llm.scores.shape[1]:
        raise SystemExit(f"{model}: vocab {llm.n_vocab()} but scores have {llm.scores.shape[1]} columns")
    llm.eval(ids)
    np.save(out, np.ascontiguousarray(llm.scores[:len(ids)], dtype=np.float32))
    return {"tokens": len(ids), "vocab": llm.n_vocab(), "llama_cpp": llama_cpp.__version__}


def genai_logits(model: str, ids_path: str, out: str, threads: int) -> dict:
    """Full-vocabulary logits float32 [T, V] of an onnxruntime-genai model folder at every position of the ids,
    appended CHUNK_TOKENS at a time to one generator (one KV cache), saved to out."""
    import onnxruntime_genai as og

    ids = np.load(ids_path).astype(np.int32)
    config = og.Config(model)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    m = og.Model(config)
    params = og.GeneratorParams(m)
    # GenAI's windowed attention wants a cache at least as long as the window (Gemma 3: 512)
    params.set_search_options(max_length=max(len(ids) + 1, GENAI_MIN_LENGTH), do_sample=False)
    gen = og.Generator(m, params)
    parts = []
    for start in range(0, len(ids), CHUNK_TOKENS):
        part = ids[start:start + CHUNK_TOKENS]
        gen.append_tokens(part)
        logits = np.asarray(gen.get_output("logits"), dtype=np.float32)  # [1, n, V]
        if logits.shape[1] != len(part):
            raise SystemExit(f"{model}: logits for {logits.shape[1]} positions after appending {len(part)} tokens")
        parts.append(logits[0])
    np.save(out, np.concatenate(parts))
    return {"tokens": len(ids), "vocab": parts[0].shape[-1], "onnxruntime_genai": og.__version__}


def tokenize(model: str, text_path: str, out: str) -> dict:
    """The text's ids int32 [T] by the GGUF's own tokenizer, with BOS first when the GGUF asks for one
    (tokenizer.ggml.add_bos_token; llama.cpp's add_bos=True means "if the model wants it"). Special tokens
    written in the text stay text, as quantize.package.encode keeps them."""
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    np.save(out, np.array(ids, dtype=np.int32))
    return {"tokens": len(ids), "llama_cpp": llama_cpp.__version__}


class _Timeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise _Timeout("took over the job's timeout_s")


def _schema_record(llm, item: dict, max_tokens: int) -> dict:
    """{"compiled", "error"} and, when item["generate"], {"finish_reason", "text"}: LlamaGrammar.from_json_schema
    (llama-cpp-python's converter to GBNF), llama.cpp's grammar parser, then a greedy chat completion."""
    from llama_cpp.llama_grammar import LlamaGrammar

    try:
        grammar = LlamaGrammar.from_json_schema(json.dumps(item["schema"]), verbose=False)
    except Exception as e:  # noqa: BLE001 -- the converter raises whatever its schema walk meets
        return {"compiled": False, "error": f"{type(e).__name__}: {e}"[:200]}
    parsed = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, grammar._grammar.encode(), grammar._root.encode())
    if not parsed:  # llama.cpp's parser refused the GBNF (a NULL sampler would crash the completion)
        return {"compiled": False, "error": "llama.cpp could not parse the converted grammar"}
    llama_cpp.llama_sampler_free(parsed)
    if not item["generate"]:
        return {"compiled": True}
    out = llm.create_chat_completion(messages=[{"role": "user", "content": item["prompt"]}], grammar=grammar,
                                     max_tokens=max_tokens, temperature=0.0)
    choice = out["choices"][0]
    return {"compiled": True, "finish_reason": choice["finish_reason"], "text": choice["message"]["content"] or ""}


def json_schemas(model: str, job_path: str, out: str, threads: int) -> dict:
    """Each schema of the job compiled (and, where asked, generated with) by llama.cpp; {url: record} to out.
    job: {"max_tokens", "timeout_s" (one schema's conversion and generation), "schemas": [{"url", "schema",
    "prompt", "generate"}]}."""
    # the converter fetches a remote $ref with `import requests; requests.get(...)`: an ImportError instead, so
    # that such a schema fails at once and offline, as it does on our side
    sys.modules["requests"] = None
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    llm = llama_cpp.Llama(model, n_ctx=SCHEMA_CONTEXT_TOKENS, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    signal.signal(signal.SIGALRM, _raise_timeout)
    records = {}
    for item in job["schemas"]:
        signal.alarm(job["timeout_s"])
        try:
            records[item["url"]] = _schema_record(llm, item, job["max_tokens"])
        except _Timeout as e:
            records[item["url"]] = {"compiled": True, "finish_reason": "timeout", "text": "", "error": str(e)}
        finally:
            signal.alarm(0)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(records, f)
    return {"schemas": len(records), "llama_cpp": llama_cpp.__version__}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("src"), q.add_argument("dst"), q.add_argument("ftype")
    lg = sub.add_parser("logits")
    lg.add_argument("model"), lg.add_argument("ids"), lg.add_argument("out")
    tk = sub.add_parser("tokenize")
    tk.add_argument("model"), tk.add_argument("text"), tk.add_argument("out")
    gl = sub.add_parser("genai-logits")
    gl.add_argument("model"), gl.add_argument("ids"), gl.add_argument("out")
    js = sub.add_parser("json-schemas")
    js.add_argument("model"), js.add_argument("job"), js.add_argument("out")
    for s in (q, lg, tk, gl, js):
        s.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if a.command == "quantize":
        result = quantize(a.src, a.dst, a.ftype, a.threads)
    elif a.command == "tokenize":
        result = tokenize(a.model, a.text, a.out)
    elif a.command == "genai-logits":
        result = genai_logits(a.model, a.ids, a.out, a.threads)
    elif a.command == "json-schemas":
        result = json_schemas(a.model, a.job, a.out, a.threads)
    else:
        result = logits(a.model, a.ids, a.out, a.threads)
    print(json.dumps(result))  # the last stdout line is the result the benchmarks read


if __name__ == "__main__":
    main(sys.argv[1:])
