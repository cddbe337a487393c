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


REAL_ARCH_PRECISIONS = ("fp32", "int8", "int4")
# Builds all of REAL_ARCH_PRECISIONS of one known model from one read of its checkpoint, in a process of its own:
# the engines the tests start in this process size themselves by its peak RSS, which a float32 checkpoint and
# its graphs would raise by GBs for the rest of the session. INT8 and INT4 use the block search without
# calibration: fast, and not what these tests check (GPTQ's tests use SmolLM2).
BUILD_REAL_ARCH = """
import sys
from pathlib import Path
from quantize.checkpoint import load_checkpoint
from quantize.fetch import fetch
from quantize.package import build_bundle
from quantize.precision import QuantSpec
name, root = sys.argv[1], Path(sys.argv[2])
ckpt = load_checkpoint(fetch(name))
for p in sys.argv[3:]:
    spec = QuantSpec(precision=p, method="search") if p != "fp32" else QuantSpec()
    build_bundle(ckpt, spec, root / f"{name}-{p}", name=name, progress=lambda s: None)
"""


@pytest.fixture(scope="session")
def real_arch_bundle(tmp_path_factory):
    """(name, precision) -> a bundle of a known real model (quantize.fetch), built with its other precisions
    on first use (BUILD_REAL_ARCH)."""
    import subprocess
    import sys

    from agent.engine.bundle import open_bundle

    built: dict = {}

    def build(name: str, precision: str = "fp32"):
        if (name, precision) not in built:
            root = tmp_path_factory.mktemp("real_arch")
            subprocess.run([sys.executable, "-c", BUILD_REAL_ARCH, name, str(root), *REAL_ARCH_PRECISIONS],
                           check=True, timeout=1800)
            built.update({(name, p): open_bundle(root / f"{name}-{p}") for p in REAL_ARCH_PRECISIONS})
        return built[name, precision]

    return build


@pytest.fixture(scope="session")
def real_arch_fp32_bundle(real_arch_bundle):
    return lambda name: real_arch_bundle(name, "fp32")


@pytest.fixture(scope="module", autouse=True)
def _free_what_the_module_held():
    """After each module, its engines' sessions and arrays are collected and glibc's free pages returned, so the
    next module's engines measure a baseline of what the session's fixtures hold, not of every earlier module
    (after the real-model API tests: 1,267 MB before, 718 MB after)."""
    yield
    import gc

    from agent.process import return_free_heap

    gc.collect()
    return_free_heap()


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


# ---- PostgreSQL: one throwaway server per session (tests/postgres.py), a fresh database per test ---------------
@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL on a free loopback port for the whole session (never the packaged cluster)."""
    from postgres import Postgres

    server = Postgres().start()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server):
    """The URL of a new, empty database, dropped after the test with any connections the test left open."""
    import psycopg
    from postgres import database_name

    url = postgres_server.fresh_database()
    yield url
    try:
        postgres_server.drop_database(database_name(url))
    except psycopg.Error:
        pass  # a database that outlives its test goes with the session's server
