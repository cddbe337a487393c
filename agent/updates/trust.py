"""Which model manifests and jobs this device trusts: Ed25519 signatures over canonical bytes.

Two roles, as TUF separates them: the manifest key (offline, `edge-fleet publish --key`) vouches for what
a model is; the job key (online, in `edge-fleet serve --job-key`) vouches for what a device is asked to do
with it (which device, until when, downgrade, download URL, speed floor, rollback). A key is named by its
key id (the first 16 hex digits of the sha256 of its raw public bytes), so a document says which key signed
it and several keys can be trusted at once (rotation).
"""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key

from agent.wire import AdapterManifest, JobDocument, Manifest


class TrustError(ValueError):
    """The manifest is unsigned, signed by an unknown key, or the signature does not match."""


class JobTimeError(TrustError):
    """A job the fleet signed for this device, refused by this device's clock (expired, issued ahead, older
    than the last job run): authentic, so the refusal can be reported, and often a wrong clock."""


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


def verify_manifest(manifest: Manifest | AdapterManifest | None, signature_b64: str | None, kid: str | None,
                    trusted: dict[str, Ed25519PublicKey]) -> None:
    if manifest is None or not signature_b64 or not kid:
        raise TrustError("the job carries no signed manifest")
    _verify(signature_b64, kid, manifest.canonical_bytes(), trusted, "the manifest")


MAX_CLOCK_SKEW_S = 24 * 3600  # a job issued further ahead of this device's clock is refused, not recorded


def verify_job(doc: JobDocument, job_keys: dict[str, Ed25519PublicKey], device_id: str, now: float,
               last_run: tuple[float, str] | None = None) -> None:
    """A device that trusts job keys takes only jobs one of them signed, for itself, unexpired, and issued
    after the last job it began, last_run = (issued_at, job_id) (a replay of an older one is refused; that
    same job again is not, since only a job that never journalled anything is run twice). No job keys:
    nothing to check."""
    if not job_keys:
        return
    if not doc.job_signature or not doc.job_key_id:
        raise TrustError("the job is not signed, and this device takes only signed jobs ([updates] job_keys)")
    _verify(doc.job_signature, doc.job_key_id, doc.signed_bytes(), job_keys, "the job")
    if doc.device_id != device_id:
        raise TrustError(f"the job is for device {doc.device_id!r}, not this one ({device_id})")
    if doc.issued_at is None or doc.expires_at is None:
        raise TrustError("the signed job has no issued_at or expires_at")
    if now > doc.expires_at:
        raise JobTimeError(f"the job expired {now - doc.expires_at:.0f} s ago by this device's clock: check the "
                           "clocks of the device and the fleet server")
    if doc.issued_at > now + MAX_CLOCK_SKEW_S:  # recorded, it would refuse every job until that date
        raise JobTimeError(f"the job was issued {doc.issued_at - now:.0f} s ahead of this device's clock: check "
                           "the clocks of the fleet server and the device")
    if last_run is not None and doc.issued_at <= last_run[0] and (doc.issued_at, doc.job_id) != last_run:
        raise JobTimeError("the job was issued before the last one this device ran: a replay, out of order, or "
                           "the fleet server's clock was set back")


def _verify(signature_b64: str, kid: str, data: bytes, trusted: dict[str, Ed25519PublicKey], what: str) -> None:
    key = trusted.get(kid)
    if key is None:
        raise TrustError(f"{what} is signed by unknown key {kid}")
    try:
        key.verify(base64.b64decode(signature_b64, validate=True), data)
    except (InvalidSignature, ValueError) as e:
        raise TrustError(f"bad signature: {what} is not what the key signed") from e
