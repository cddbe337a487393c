"""The fleet's published LoRA adapters: `edge-fleet publish ADAPTER_DIR --key KEY` verifies a converted adapter
(edge-quantize adapter), signs its manifest with the key that signs bundles and copies it where the artifact
server serves it (ARTIFACTS/adapters/NAME@VERSION/); `edge-fleet deploy MODEL@VERSION:ADAPTER@VERSION` names
one by the base build it fits and its own name and version (adapter_target).

Table (migration 0016_adapter_rollouts): adapters(name, version, base_name, base_version, manifest, signature,
key_id, published_at).
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from pydantic import ValidationError

from agent import durable, wire
from agent.engine.bundle import verify
from fleet.db import Database
from fleet.signing import load_private_key, sign_manifest

ARTIFACTS_SUBDIR = "adapters"  # under the artifacts directory: no model's NAME@VERSION is this bare word


def is_adapter(folder: Path) -> bool:
    return (Path(folder) / wire.ADAPTER_MANIFEST).is_file()


def publish_adapter(db: Database, folder: Path, key_path: Path, artifacts_dir: Path) -> str:
    """Verify an adapter, sign its manifest, copy it under the artifacts; returns MODEL@VERSION:ADAPTER@VERSION."""
    try:
        m = wire.AdapterManifest.read(folder)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"{folder}: invalid {wire.ADAPTER_MANIFEST}: {'.'.join(map(str, err['loc']))}: "
                         f"{err['msg']}") from None
    verify(Path(folder), m)  # every file against its sha256: a damaged copy is never signed
    signature, kid = sign_manifest(m, load_private_key(key_path))
    dest = Path(artifacts_dir) / ARTIFACTS_SUBDIR / f"{m.name}@{m.version}"
    if not dest.exists():
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(folder, tmp)
        durable.move_into_place(tmp, dest)  # on disk before the row below offers it to devices
    db["adapters"].upsert({"name": m.name, "version": m.version, "base_name": m.base_name,
                           "base_version": m.base_version, "manifest": m.model_dump_json(), "signature": signature,
                           "key_id": kid, "published_at": time.time()}, pk=("name", "version"))
    return f"{m.base_name}@{m.base_version}:{m.name}@{m.version}"


@dataclass(frozen=True)
class AdapterTarget:
    base_name: str
    base_version: str
    name: str
    version: str


def adapter_target(db: Database, target: str) -> AdapterTarget:
    """MODEL@VERSION:ADAPTER@VERSION, published, and published for that base; ValueError saying what to fix."""
    base, _, adapter = target.partition(":")
    (base_name, _, base_version), (name, _, version) = base.partition("@"), adapter.partition("@")
    if not all((base_name, base_version, name, version)):
        raise ValueError(f"{target!r}: an adapter deployment is MODEL@VERSION:ADAPTER@VERSION")
    row = next(db.query("select base_name, base_version from adapters where name = ? and version = ?",
                        [name, version]), None)
    if row is None:
        raise ValueError(f"{name}@{version} is not published (edge-fleet publish ADAPTER_DIR --key KEY)")
    if (row["base_name"], row["base_version"]) != (base_name, base_version):
        raise ValueError(f"{name}@{version} is for {row['base_name']}@{row['base_version']}, not {base}: deploy "
                         f"{row['base_name']}@{row['base_version']}:{name}@{version}")
    return AdapterTarget(base_name, base_version, name, version)


def adapter_document_fields(db: Database, job: dict, base_url: str) -> dict:
    """The JobDocument fields of an adapter job: the signed adapter manifest and, to install, where its files are."""
    row = db["adapters"].get((job["adapter"], job["adapter_version"]))
    path = quote(f"{ARTIFACTS_SUBDIR}/{job['adapter']}@{job['adapter_version']}", safe="@/")
    install = job["operation"] == "install_adapter"
    return {"adapter": wire.AdapterManifest.model_validate_json(row["manifest"]), "signature": row["signature"],
            "key_id": row["key_id"], "base_url": f"{base_url}/{path}" if install else None}
