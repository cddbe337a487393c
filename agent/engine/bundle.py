"""Open a model bundle written by edge-quantize: verify every file against its manifest, then load it.

Verification comes first and is all-or-nothing: a missing, resized or altered file (or a manifest that
names a path outside the bundle) is a BundleError and nothing is loaded.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from agent import wire


class BundleError(ValueError):
    """The bundle cannot be trusted or read; the message says which file and why."""


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: wire.Manifest | None  # None while edge-quantize builds it
    config: wire.ModelConfig

    def graph(self, kv_dtype: str = "fp32") -> Path:
        """The graph that runs with this KV cache type; BundleError if the bundle has none. Only a graph its
        manifest lists (and so verified) is ever loaded: an unlisted model.int8kv.onnx dropped into a bundle is
        as absent."""
        name = wire.GRAPH_INT8_KV if kv_dtype == "int8" else wire.GRAPH
        graph = self.path / name
        if (self.manifest is None or name in self.manifest.files) and graph.is_file():  # None: being built
            return graph
        label = self.label
        if kv_dtype != "int8":
            raise BundleError(f"{label} has no {wire.GRAPH}")
        raise BundleError(f"{label} has no int8 KV cache graph "
                          f"({wire.GRAPH_INT8_KV}): rebuild it with edge-quantize build (which calibrates one), "
                          f"or set kv_dtype = \"fp32\"")

    def tokenizer_json(self) -> str:
        return (self.path / wire.TOKENIZER).read_text()

    @property
    def label(self) -> str:
        return str(self.path) if self.manifest is None else f"{self.manifest.name}@{self.manifest.version}"

    def draft(self) -> "Bundle | None":
        """The draft model this bundle carries (edge-quantize build --draft), or None. Its files are this
        bundle's too, verified with them when the bundle was opened, so they are not hashed again."""
        if self.manifest is None or self.manifest.draft is None:
            return None
        draft = open_bundle(self.path / wire.DRAFT_DIR, verify_files=False)
        if (draft.manifest.name, draft.manifest.version) != (self.manifest.draft.name, self.manifest.draft.version):
            raise BundleError(f"{self.label}: its {wire.DRAFT_DIR}/ holds {draft.label}, its manifest names "
                              f"{self.manifest.draft.name}@{self.manifest.draft.version}")
        return draft

    def check_servable(self) -> None:
        """BundleError for a draft-only bundle: a head over the first head_vocab ids (edge-quantize build
        --head-vocab) can never pick the ids past them, end ids included, so only a target may verify its guesses."""
        head_vocab = self.config.quant.get("head_vocab")
        if head_vocab:
            raise BundleError(f"{self.label} is a draft model (its head covers {head_vocab} of "
                              f"{self.config.vocab_size} tokens): it drafts for a target, it cannot serve requests")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def safe_member(root: Path, rel: str) -> Path:
    """root/rel, refusing absolute paths and '..' that would escape the bundle directory."""
    if "\x00" in rel:  # no file can have it; resolve() raised ValueError ("embedded null byte"), not BundleError
        raise BundleError(f"{root}: manifest names a file with a NUL byte: {rel!r}")
    p, inside = (root / rel).resolve(), root.resolve()
    # p == inside: '' or 'x/..' named the bundle directory itself, which the updater then tried to unlink()
    if Path(rel).is_absolute() or not p.is_relative_to(inside) or p == inside:
        raise BundleError(f"{root}: manifest names a file outside the bundle: {rel!r}")
    return p


def verify(root: Path, manifest: wire.Manifest) -> None:
    for rel, entry in manifest.files.items():
        p = safe_member(root, rel)
        if not p.is_file():
            raise BundleError(f"{root}: missing file {rel}")
        if p.stat().st_size != entry.size_bytes:
            raise BundleError(f"{root}: {rel} is {p.stat().st_size} bytes, manifest says {entry.size_bytes}")
        if file_sha256(p) != entry.sha256:
            raise BundleError(f"{root}: {rel} does not match its sha256 in the manifest")


def open_bundle(path: Path, verify_files: bool = True) -> Bundle:
    root = Path(path)
    try:
        str(root.absolute()).encode()
    except UnicodeEncodeError:  # ONNX Runtime takes a path as text: it failed with a bare TypeError
        raise BundleError(f"{os.fsencode(root)!r}: a bundle's path must be valid UTF-8 for ONNX Runtime") from None
    try:
        manifest = wire.Manifest.read(root)
        if verify_files:
            verify(root, manifest)
        return Bundle(root, manifest, wire.ModelConfig.read(root))
    except FileNotFoundError as e:
        raise BundleError(f"{root}: not a model bundle (missing {Path(e.filename).name})") from e
    except ValidationError as e:
        raise BundleError(f"{root}: invalid manifest or model config: {e.error_count()} problem(s): "
                          f"{e.errors()[0]['loc']} {e.errors()[0]['msg']}") from e
