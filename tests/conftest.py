"""Shared fixtures: tiny GGUF models built in the test, and the bundled real model."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import quantize  # noqa: F401  before tests/ joins sys.path: its quantize/ folder would pass for the package
# (resources.files("quantize") then named tests/quantize, when those tests ran alone)

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py and tests/tiny.py

from tiny import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_gguf):
    from quantize.checkpoint import load_checkpoint

    return load_checkpoint(tiny_gguf)


@pytest.fixture(scope="session")
def tiny_varied_checkpoint(tmp_path_factory):
    """A tiny model whose greedy text depends on its context: the default one repeats a single token, so
    comparing texts token for token on it cannot catch a wrong KV cache (found in review)."""
    from quantize.checkpoint import load_checkpoint

    path = tmp_path_factory.mktemp("tiny-varied") / "tiny.gguf"
    return load_checkpoint(write_tiny_llama(path, seed=1, layers=3, tied=False, weight_scale=0.25))


@pytest.fixture(scope="session")
def tiny_fp32_bundle(tiny_checkpoint, tmp_path_factory):
    """The tiny model as an fp32 bundle, for tests that run the agent as a process."""
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    return build_bundle(tiny_checkpoint, QuantSpec(), tmp_path_factory.mktemp("tiny") / "fp32", name="tiny",
                        progress=lambda s: None)


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    from quantize.fetch import fetch

    return fetch("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def real_checkpoint(real_gguf):
    from quantize.checkpoint import load_checkpoint

    return load_checkpoint(real_gguf)


@pytest.fixture(scope="session")
def real_fp32_bundle(real_checkpoint, tmp_path_factory):
    """The real SmolLM2 as an fp32 bundle (built once per test session)."""
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    return build_bundle(real_checkpoint, QuantSpec(), tmp_path_factory.mktemp("real") / "fp32", name="smollm2",
                        progress=lambda s: None)


@pytest.fixture
def broker(tmp_path):
    """A real Mosquitto on a free loopback port, for one test."""
    from broker import Broker

    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def real_q4_bundle(real_checkpoint, tmp_path_factory):
    """The real SmolLM2 as an INT4 bundle keeping the GGUF's own Q4_1 blocks (fast to build, no calibration)."""
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    return build_bundle(real_checkpoint, QuantSpec(precision="int4", keep_source_quant=True),
                        tmp_path_factory.mktemp("real") / "q4", name="smollm2", progress=lambda s: None)


@pytest.fixture(scope="session")
def real_arch_checkpoint():
    """name -> the Checkpoint of a known real model (quantize.fetch), each read once per session."""
    from quantize.checkpoint import load_checkpoint
    from quantize.fetch import fetch

    loaded: dict = {}

    def load(name: str):
        if name not in loaded:
            loaded[name] = load_checkpoint(fetch(name))
        return loaded[name]

    return load


@pytest.fixture(scope="session")
def real_arch_bundle(real_arch_checkpoint, tmp_path_factory):
    """(name, precision) -> a bundle of a known real model, each built once per session. INT8 and INT4 use the
    block search without calibration: fast, and not what these tests check (GPTQ's tests use SmolLM2)."""
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    built: dict = {}

    def build(name: str, precision: str = "fp32"):
        if (name, precision) not in built:
            spec = QuantSpec(precision=precision, method="search") if precision != "fp32" else QuantSpec()
            out = tmp_path_factory.mktemp("real_arch") / f"{name}-{precision}"
            built[name, precision] = build_bundle(real_arch_checkpoint(name), spec, out, name=name,
                                                  progress=lambda s: None)
        return built[name, precision]

    return build


@pytest.fixture(scope="session")
def real_arch_fp32_bundle(real_arch_bundle):
    return lambda name: real_arch_bundle(name, "fp32")


# ---- figures: what a reliability test measured, printed at the end of every run --------------------------------
FIGURES: list[str] = []


@pytest.fixture(scope="session")
def figures() -> list[str]:
    """Append one line per measured figure ("soak: 912 requests answered, ..."); the run prints them all."""
    return FIGURES


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("measured figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
