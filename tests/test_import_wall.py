"""The runtime wall: onnxruntime and paho each stay behind their own modules.

The fleet server and the policy code (scheduling, sampling, memory planning, the stores) must import with
neither package present, so that they run and are tested without an inference runtime or an MQTT client.
Each part imports a list of modules in one fresh interpreter in which the blocked package is None in
sys.modules (so `import onnxruntime` raises ImportError), and reports every module that failed with the
import chain from it to the blocked package. A third part reads the source: only the named modules import
the packages at all.
"""
from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("agent", "fleet", "quantize")

# agent modules that drive the runtime: the runner itself, those that must run it (the engine loop, the draft
# model, the golden health check's measurement) and the service wiring that starts them
RUNTIME_MODULES = ("agent.engine.runner", "agent.engine.engine", "agent.engine.draft", "agent.engine.golden")
RUNTIME_PACKAGES = ("agent.service",)
CHECKPOINT_READERS = ["quantize.checkpoint", "quantize.gguf_reader", "quantize.hf", "quantize.tokenizer"]
PAHO_FREE = ["fleet.store", "fleet.queries", "fleet.report", "agent.link.store", "agent.engine.scheduler",
             "agent.engine.sampler", "agent.engine.memory"]

ONLY_IMPORTERS = {
    "onnxruntime": {"agent/engine/runner.py"},
    "paho": {"agent/link/mqtt.py", "fleet/mqtt.py"},
}

# Runs in the fresh interpreter: argv[1] is the blocked package, argv[2:] the modules. Prints one JSON object:
# module -> (error, chain of this repository's modules the failing import went through).
PROBE = r"""
import json, sys, traceback
from pathlib import Path
blocked, modules = sys.argv[1], sys.argv[2:]
sys.modules[blocked] = None
root = Path.cwd().resolve()
failed = {}
for name in modules:
    try:
        __import__(name)
    except BaseException as e:
        chain = []
        for frame in traceback.extract_tb(e.__traceback__):
            path = Path(frame.filename).resolve()
            if path.is_relative_to(root) and path.suffix == ".py":
                module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                if not chain or chain[-1] != module:
                    chain.append(module)
        failed[name] = [f"{type(e).__name__}: {e}", chain]
print(json.dumps(failed))
"""


def package_modules(package: str) -> list[str]:
    """Every module and subpackage of `package`, found on disk (nothing is imported here)."""
    names = [package]
    for info in pkgutil.iter_modules([str(ROOT / package.replace(".", "/"))], package + "."):
        names += package_modules(info.name) if info.ispkg else [info.name]
    return names


def runtime_free_modules() -> list[str]:
    agent = [m for m in package_modules("agent") if m not in RUNTIME_MODULES
             and not any(m.startswith(p + ".") for p in RUNTIME_PACKAGES)]
    return package_modules("fleet") + agent + CHECKPOINT_READERS


def failures(blocked: str, modules: list[str]) -> dict[str, list]:
    r = subprocess.run([sys.executable, "-c", PROBE, blocked, *modules], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def describe(failed: dict[str, list]) -> str:
    return "\n".join(f"{name}: {error} (via {' -> '.join(chain)})" for name, (error, chain) in failed.items())


def test_modules_import_without_onnxruntime():
    modules = runtime_free_modules()
    assert "fleet.store" in modules and "agent.engine.scheduler" in modules and "agent.engine.runner" not in modules
    failed = failures("onnxruntime", modules)
    assert not failed, "these modules need onnxruntime:\n" + describe(failed)


def test_stores_queries_and_policy_import_without_paho():
    failed = failures("paho", PAHO_FREE)
    assert not failed, "these modules need paho:\n" + describe(failed)


def imported_packages(source: str) -> set[str]:
    """Top-level names of every package a module imports, at any depth of its code (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_wall_modules_import_onnxruntime_and_paho():
    importers: dict[str, set[str]] = {package: set() for package in ONLY_IMPORTERS}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            found = imported_packages(path.read_text())
            for blocked in importers:
                if blocked in found:
                    importers[blocked].add(path.relative_to(ROOT).as_posix())
    assert importers == ONLY_IMPORTERS
