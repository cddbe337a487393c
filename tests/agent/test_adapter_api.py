"""LoRA adapters over the local API: the model field "BASE:ADAPTER" chooses one per request on both completion
endpoints, /v1/models lists the base and its adapters, and an unknown adapter is a 404 in OpenAI's shape; plus
edge-agent generate --adapter and the config's [adapters] / --adapter NAME=DIR."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from agent.api.backend import Backend
from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine.sampling_params import SamplingParams
from agent.service.lifecycle import ModelLifecycle
from agent.service.serve import load_agent_config
from agent.updates.model_store import ModelStore
from lora_support import bundle_with_adapters
from api_support import serving

CONFIG = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=16)
PROMPT = [5, 17, 33, 60, 7, 99, 120, 8]


@pytest.fixture(scope="module")
def made(tiny_varied_checkpoint, tmp_path_factory):
    return bundle_with_adapters(tiny_varied_checkpoint, tmp_path_factory.mktemp("adapter-api"))


@pytest.fixture(scope="module")
def engine(made):
    bundle, folders = made
    engine = Engine(bundle, CONFIG, adapters=folders)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def api(made, engine):
    with serving(made[0], engine) as served:
        yield served


def greedy_text(engine: Engine, adapter: str | None) -> str:
    return engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), adapter).text


def test_the_model_field_chooses_the_adapter_on_both_endpoints(api, engine):
    client = api.openai()
    texts = {}
    for model, adapter in (("tiny", None), ("tiny:a1", "a1"), ("tiny:a2", "a2")):
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert r.model == model
        texts[model] = r.choices[0].text
        assert texts[model] == greedy_text(engine, adapter)
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                              temperature=0)
        assert chat.model == model and chat.usage.completion_tokens >= 1
    assert len(set(texts.values())) == 3  # each adapter changes the text: the test above can fail
    name_at_version = f"tiny@{engine.bundle.manifest.version}:a1"
    assert client.completions.create(model=name_at_version, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text == texts["tiny:a1"]


def test_models_lists_the_base_and_its_adapters(api, engine):
    client = api.openai()
    cards = client.models.list().data
    assert [c.id for c in cards] == ["tiny", "tiny:a1", "tiny:a2"]
    a1 = client.models.retrieve("tiny:a1")
    assert a1.model_extra["parent"] == "tiny" and a1.model_extra["version"] == engine.adapters["a1"].manifest.version
    assert cards[0].model_extra["parent"] is None


@pytest.mark.parametrize("model", ["tiny:nope", "tiny:", "other:a1"])
def test_an_unknown_adapter_is_a_404_in_openais_shape(api, model):
    client = api.openai()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert e.value.body["type"] == "invalid_request_error"
    if model == "tiny:nope":
        assert "'nope'" in e.value.body["message"] and "tiny:a1, tiny:a2" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(model)


def test_generate_takes_an_adapter(made, engine):
    bundle, folders = made
    out = subprocess.run([sys.executable, "-m", "agent.service.cli", "generate", "--model", str(bundle.path),
                          "--adapter", str(folders["a2"]), "--max-tokens", "8", "--ignore-eos", "--json",
                          "--threads", "2", "x"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ids = engine.tokenizer.encode("x")
    want = engine.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "a2").text
    assert json.loads(out.stdout)["text"] == want
    bad = subprocess.run([sys.executable, "-m", "agent.service.cli", "generate", "--model", str(bundle.path),
                          "--adapter", str(bundle.path), "x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "is not an adapter" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_takes_adapters_from_flags_the_config_and_the_state_directory(made, tmp_path):
    bundle, folders = made
    toml = tmp_path / "agent.toml"
    toml.write_text(f'[adapters]\na1 = "{folders["a1"]}"\nkeep = "/x"\n')
    config = load_agent_config(toml, adapters={"a1": folders["a2"], "b": folders["a2"]})
    assert config.adapters == {"a1": folders["a2"], "keep": Path("/x"), "b": folders["a2"]}  # flags win by name
    store = ModelStore(tmp_path / "state")
    m = bundle.manifest
    assert store.adapters_for(m) == {}
    installed = tmp_path / "state" / "adapters" / f"{m.name}@{m.version}" / "support"
    shutil.copytree(folders["a1"], installed)
    shutil.copytree(folders["a2"], tmp_path / "state" / "adapters" / "tiny@another-build" / "x")  # never looked at
    assert store.adapters_for(m) == {"support": installed}
    models = ModelLifecycle(Backend(m), CONFIG, adapters=lambda b: {**store.adapters_for(b.manifest), "a2": folders["a2"]})
    engine = models.load(bundle.path)
    try:
        assert list(engine.adapters) == ["support", "a2"]
        assert engine.adapters["support"].manifest.name == "a1"  # served by its folder's name
    finally:
        engine.stop()


def test_serve_refuses_a_malformed_adapter_flag():
    r = subprocess.run([sys.executable, "-m", "agent.service.cli", "serve", "--adapter", "nofolder"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "give NAME=DIR" in r.stderr and "Traceback" not in r.stderr


def test_telemetry_records_each_requests_adapter(api, engine, tmp_path):
    from agent.config import TelemetryConfig
    from agent.link.store import TelemetryStore
    from agent.link.telemetry import DB_NAME, Telemetry

    telemetry = Telemetry(TelemetryStore(tmp_path / DB_NAME, "dev-1"), TelemetryConfig(state_dir=tmp_path))
    hook = lambda m, fin: telemetry.record_request(m.name, m.version, fin.figures, fin.adapter)  # noqa: E731 (serve's)
    api.server.backend.on_finished.append(hook)
    try:
        for model in ("tiny", "tiny:a2"):
            api.openai().completions.create(model=model, prompt=PROMPT, max_tokens=2)
    finally:
        api.server.backend.on_finished.remove(hook)
    a2 = f"a2@{engine.adapters['a2'].manifest.version}"
    assert [r.record.request.adapter for r in telemetry.store.unsent(10)] == [None, a2]
    rows = telemetry.store.db.execute("SELECT model, adapter FROM requests ORDER BY id").fetchall()
    assert [tuple(r) for r in rows] == [("tiny", None), ("tiny", a2)]
    telemetry.store.close()
