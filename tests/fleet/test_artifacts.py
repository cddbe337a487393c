"""The artifact server devices download bundles from: only the published files, whole or by Range."""
from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request

import pytest

from fleet.artifacts import ArtifactServer, RangeHandler


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "artifacts"
    (root / "m@1").mkdir(parents=True)
    (root / "m@1" / "model.onnx").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "secret.txt").write_text("TOPSECRET")
    server = ArtifactServer(root).start()
    yield server, root
    server.stop()


def get(server, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(server.base_url + path, headers=headers or {}),
                                    timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_a_file_whole_and_by_range(served):
    server, _ = served
    status, body = get(server, "/m@1/model.onnx")
    assert status == 200 and len(body) == 1024
    assert get(server, "/m@1/model.onnx", {"Range": "bytes=1000-"}) == (206, bytes(range(232, 256)))
    assert get(server, "/m@1/model.onnx", {"Range": "bytes=2000-"})[0] == 416


def test_nothing_outside_the_published_files_is_served(served, tmp_path):
    """Found in review: a symlink leading out of the root was followed, and `.NAME.tmp` (a bundle being copied
    in) could be downloaded half-written."""
    server, root = served
    (root / "m@1" / "link").symlink_to(tmp_path / "secret.txt")
    (root / "outside").symlink_to(tmp_path)
    (root / ".m@2.tmp").mkdir()
    (root / ".m@2.tmp" / "model.onnx").write_bytes(b"half")
    os.mkfifo(root / "m@1" / "fifo")
    for path in ("/m@1/link", "/outside/secret.txt", "/.m@2.tmp/model.onnx", "/m@1/fifo", "/../secret.txt",
                 "/%2e%2e/secret.txt", "/m@1", "/missing"):
        assert get(server, path)[0] == 404, path


def test_a_client_that_stalls_is_let_go(served, monkeypatch):
    """Found in review: one thread per connection and no timeout: a stalled client held its thread for good."""
    server, _ = served
    assert RangeHandler.timeout and RangeHandler.timeout <= 120
    monkeypatch.setattr(RangeHandler, "timeout", 0.5)  # for the test: the same mechanism, sooner
    host, port = server.httpd.server_address[:2]
    conn = socket.create_connection((host, port), timeout=5)
    conn.sendall(b"GET /m@1/model.onnx HTTP/1.1\r\n")  # and nothing more
    t0 = time.monotonic()
    assert conn.recv(4096) == b"" and time.monotonic() - t0 < 4
    conn.close()


def test_republishing_replaces_the_bundle_whole(served, tmp_path):
    server, root = served
    new = tmp_path / "new"
    new.mkdir()
    (new / "model.onnx").write_bytes(b"v2")
    server.publish_dir(new, "m@1")
    assert get(server, "/m@1/model.onnx") == (200, b"v2")
    assert sorted(p.name for p in root.iterdir()) == ["m@1"]
