"""Signing for rollouts: Ed25519 key pairs and detached signatures (the `cryptography` package).

`edge-fleet keygen --out PATH` writes PATH (private, mode 0600) and PATH.pub. `edge-fleet publish --key`
signs a bundle's canonical manifest bytes (keep that key offline); `edge-fleet serve --job-key` signs each
job document as it goes to one device (an online key, which can only ask devices to install, or roll back
to, what the manifest key signed). Devices verify with agent.updates.trust against the public keys they trust.
"""
from __future__ import annotations

import base64
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (Encoding, NoEncryption, PrivateFormat, PublicFormat,
                                                          load_pem_private_key)

from agent import durable
from agent.updates.trust import key_id
from agent.wire import AdapterManifest, JobDocument, Manifest


def keygen(out: Path) -> str:
    """Write a new key pair; returns its key id. Refuses to overwrite an existing key."""
    out = Path(out)
    if out.exists() or out.with_name(out.name + ".pub").exists():
        raise FileExistsError(f"{out} already exists; refusing to overwrite a signing key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    # Both whole and on disk, or neither: a full disk left a 0-byte key that the next keygen refused to
    # replace, and a power cut soon after could empty a key whose .pub was already in device images.
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # `keygen --out keys/fleet.key`, as the README has it
    durable.create_new(out, pem, 0o600)
    try:
        durable.create_new(out.with_name(out.name + ".pub"),
                           key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return key_id(key.public_key())


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = load_pem_private_key(Path(path).read_bytes(), password=None)
    except TypeError as e:  # cryptography's "Password was not given but private key is encrypted"
        raise ValueError(f"{path}: the key is encrypted; give an unencrypted Ed25519 key (edge-fleet keygen)") from e
    except ValueError as e:  # cryptography's message names no file
        raise ValueError(f"{path}: not a PEM private key ({str(e).split('.')[0]})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 private key")
    return key


def sign_manifest(manifest: Manifest | AdapterManifest, key: Ed25519PrivateKey) -> tuple[str, str]:
    """(base64 signature, key id) over the manifest's canonical bytes (a bundle's, or a LoRA adapter's)."""
    return base64.b64encode(key.sign(manifest.canonical_bytes())).decode(), key_id(key.public_key())


def sign_job(doc: JobDocument, key: Ed25519PrivateKey, device_id: str, issued_at: float, ttl_s: float) -> JobDocument:
    """doc for one device, valid from issued_at for ttl_s, signed over everything it says."""
    issued_at = float(issued_at)  # as the device parses it back: an int would be signed as '1700000000'
    bound = doc.model_copy(update={"device_id": device_id, "issued_at": issued_at, "expires_at": issued_at + float(ttl_s),
                                   "job_signature": None, "job_key_id": None})
    signature = base64.b64encode(key.sign(bound.signed_bytes())).decode()
    return bound.model_copy(update={"job_signature": signature, "job_key_id": key_id(key.public_key())})
