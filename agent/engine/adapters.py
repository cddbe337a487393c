"""The LoRA adapters an engine serves beside its bundle: each verified (every file's sha256, then that it fits
the base: its name and version, targets, rank, and every tensor's shape) before a request can name it.

An adapter is a folder edge-quantize adapter wrote (agent.wire.ADAPTER_FILE + ADAPTER_MANIFEST). Loading is two
steps so that the memory budget can refuse one before its bytes are read: `check_adapter` (manifest, hashes,
fit; its size from the manifest) and `load_tensors` (the tensors, copied into memory of our own).

Example:
    found = {name: check_adapter(name, folder, bundle) for name, folder in folders.items()}
    adapters = {name: a.load_tensors(runner) for name, a in found.items()}   # after the budget took their bytes
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from agent import wire
from agent.engine.bundle import Bundle, BundleError, verify

if TYPE_CHECKING:  # handed a runner, never loading one: this module imports without the runtime
    from agent.engine.runner import LoraTensors, ModelRunner


class AdapterError(ValueError):
    """An adapter that cannot be served on this bundle; the message names the adapter and what differs."""


@dataclass(frozen=True, eq=False)
class Adapter:
    name: str  # what a request's model field names it by: BASE:NAME
    path: Path
    manifest: wire.AdapterManifest
    tensors: LoraTensors | None = None  # set by load_tensors

    @property
    def label(self) -> str:
        return f"adapter {self.name!r} ({self.manifest.name}@{self.manifest.version}, {self.path})"

    @property
    def nbytes(self) -> int:
        """What it holds in memory once loaded: its tensors, the adapter file less its few-kB header."""
        return self.manifest.files[wire.ADAPTER_FILE].size_bytes

    @property
    def prefix_salt(self) -> bytes:
        """Seeds its prompts' prefix-cache chain: KV computed with one adapter never serves another's prompt."""
        return hashlib.sha256(f"{self.manifest.name}@{self.manifest.version}".encode()).digest()

    def load_tensors(self, runner: ModelRunner) -> "Adapter":
        """This adapter with its tensors read; AdapterError naming the first tensor that does not fit the graph."""
        from agent.engine.runner import LoraTensors, read_adapter_arrays

        arrays = read_adapter_arrays(self.path / wire.ADAPTER_FILE)
        check_shapes(self.label, {k: a.shape for k, a in arrays.items()}, runner.lora_shapes)
        return Adapter(self.name, self.path, self.manifest, LoraTensors.wrap(arrays))


def check_adapter(name: str, folder: Path, bundle: Bundle) -> Adapter:
    """The adapter in folder, to be served as `name` on bundle: AdapterError naming what is wrong with it."""
    if not re.fullmatch(wire.MODEL_NAME_PATTERN, name):
        raise AdapterError(f"adapter name {name!r}: use letters, digits and _.+- (up to 64; no ':' or '@')")
    folder = Path(folder)
    try:
        manifest = wire.AdapterManifest.read(folder)
        verify(folder, manifest)  # every file against its sha256, before anything of it is read
    except FileNotFoundError as e:
        raise AdapterError(f"adapter {name!r}: {folder} is not an adapter (missing {Path(e.filename).name}; "
                           f"edge-quantize adapter writes one)") from None
    except (ValidationError, BundleError) as e:
        raise AdapterError(f"adapter {name!r}: {_first_line(e)}") from None
    adapter = Adapter(name, folder, manifest)
    check_fit(adapter.label, manifest, bundle)
    return adapter


def check_fit(label: str, m: wire.AdapterManifest, bundle: Bundle) -> None:
    """AdapterError naming the first way the adapter's manifest does not fit the bundle."""
    base = bundle.manifest
    if (m.base_name, m.base_version) != (base.name, base.version):
        raise AdapterError(f"{label} is for {m.base_name}@{m.base_version}, not {base.name}@{base.version}: an "
                           f"adapter fits the one build it was converted for")
    if base.lora is None:
        raise AdapterError(f"{label}: {bundle.label} takes no adapters (build it with edge-quantize build "
                           f"--lora-targets)")
    if missing := [t for t in m.targets if t not in base.lora.targets]:
        raise AdapterError(f"{label} adapts {', '.join(missing)}, which {bundle.label} has no LoRA branch for "
                           f"(it takes {', '.join(base.lora.targets)})")
    if m.rank > base.lora.max_rank:
        raise AdapterError(f"{label} has rank {m.rank}, over {bundle.label}'s maximum of {base.lora.max_rank}")
    if wire.ADAPTER_FILE not in m.files:
        raise AdapterError(f"{label}: its manifest lists no {wire.ADAPTER_FILE}")


def check_shapes(label: str, shapes: dict[str, tuple[int, ...]], graph: dict[str, tuple[int, int]]) -> None:
    """AdapterError unless the adapter names exactly the graph's LoRA inputs, A [in, r] and B [r, out] with the
    graph's in and out (graph: the rank-0 shapes, A [in, 0] and B [0, out])."""
    if missing := sorted(graph.keys() - shapes.keys()):
        raise AdapterError(f"{label} has no tensor {missing[0]} (and {len(missing) - 1} more) the graph takes")
    if extra := sorted(shapes.keys() - graph.keys()):
        raise AdapterError(f"{label} has a tensor {extra[0]} the graph does not take")
    for name, want in graph.items():
        got = shapes[name]
        fixed = 0 if want[0] else 1  # A's in (rows) or B's out (columns)
        if len(got) != 2 or got[fixed] != want[fixed]:
            raise AdapterError(f"{label}: {name} is {list(got)}, the graph's is {list(want)} with rank in place of 0")
    for a in (n for n in graph if n.endswith("_A")):
        if shapes[a][1] != shapes[a[:-1] + "B"][0]:
            raise AdapterError(f"{label}: {a} has rank {shapes[a][1]}, its B {shapes[a[:-1] + 'B'][0]}")


def _first_line(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        return f"invalid {wire.ADAPTER_MANIFEST}: {'.'.join(map(str, err['loc']))}: {err['msg']}"
    return str(e).splitlines()[0]
