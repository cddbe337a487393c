"""Which model manifests this device trusts: Ed25519 signatures over the canonical manifest bytes.

A key is named by its key id (the first 16 hex digits of the sha256 of its raw public bytes), so a job
says which key signed it and several keys can be trusted at once (rotation).
"""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key

from agent.wire import Manifest


class TrustError(ValueError):
    """The manifest is unsigned, signed by an unknown key, or the signature does not match."""


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def load_trusted_keys(paths: list[Path]) -> dict[str, Ed25519PublicKey]:
    keys = {}
    for p in paths:
        try:
            key = load_pem_public_key(Path(p).read_bytes())
        except ValueError as e:  # cryptography's message names no file
            raise TrustError(f"{p}: not a PEM public key ({str(e).split('.')[0]})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise TrustError(f"{p}: not an Ed25519 public key")
        keys[key_id(key)] = key
    return keys


def verify_manifest(manifest: Manifest | None, signature_b64: str | None, kid: str | None,
                    trusted: dict[str, Ed25519PublicKey]) -> None:
    if manifest is None or not signature_b64 or not kid:
        raise TrustError("the job carries no signed manifest")
    key = trusted.get(kid)
    if key is None:
        raise TrustError(f"signed by unknown key {kid}")
    try:
        key.verify(base64.b64decode(signature_b64, validate=True), manifest.canonical_bytes())
    except (InvalidSignature, ValueError) as e:
        raise TrustError("bad signature: the manifest is not what the key signed") from e
