"""Serving model bundle files over HTTP with Range requests, so devices can resume interrupted downloads.

Files are served read-only from one directory tree (published bundles, by name@version); paths that
escape it are refused. Large files never travel over MQTT.
Run: edge-fleet serve ... --artifacts-http 127.0.0.1:PORT
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import threading
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from agent import durable

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class RangeHandler(SimpleHTTPRequestHandler):
    """GET and HEAD of files under the server's directory, honouring a single `Range: bytes=a-[b]`."""

    timeout = 60  # a client that stalls (or opens and sends nothing) held its thread and socket for good

    def list_directory(self, path):  # no directory listings
        self.send_error(HTTPStatus.NOT_FOUND)
        return None

    def log_message(self, format, *args):  # quiet: the fleet logs requests its own way
        pass

    def _served_file(self):
        """The requested file, open, or None: nothing a symlink leads outside the root to, nothing under a
        dot-name (a bundle being copied in is `.NAME.tmp`). Opened before anything is sent, so a file
        that goes meanwhile is a 404, not a 200 without a body."""
        base = Path(self.directory)
        path = Path(self.translate_path(self.path))
        try:
            relative = path.relative_to(base)
            hidden = any(part.startswith(".") for part in relative.parts)
            if hidden or not path.resolve().is_relative_to(base.resolve()) or not path.is_file():
                return None  # is_file: opening a FIFO would block this thread until someone writes to it
            f = open(path, "rb")
        except (OSError, ValueError):  # missing, a directory, unreadable; not under the root at all
            return None
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a FIFO or device would block or never end
            f.close()
            return None
        return f

    def send_head(self):
        f = self._served_file()
        if f is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        size = os.fstat(f.fileno()).st_size
        start, end = 0, size - 1
        m = _RANGE.match(self.headers.get("Range", ""))
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            if start >= size or start > end:
                f.close()
                self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                self.send_header("Content-Range", f"bytes */{size}")
                self.end_headers()
                return None
            self.send_response(HTTPStatus.PARTIAL_CONTENT)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(HTTPStatus.OK)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        f.seek(start)
        self._remaining = end - start + 1
        return f

    def copyfile(self, source, outputfile):
        remaining = self._remaining
        while remaining > 0:
            chunk = source.read(min(1 << 20, remaining))
            if not chunk:
                break
            outputfile.write(chunk)
            remaining -= len(chunk)


WILDCARD_HOSTS = ("", "0.0.0.0", "::")  # every interface: no address a device could fetch from


class ArtifactServer:
    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0, handler=RangeHandler,
                 public_url: str | None = None):
        """public_url: what devices fetch from (needed behind a wildcard bind, a NAT or a proxy)."""
        if public_url is None and host in WILDCARD_HOSTS:
            raise ValueError(f"artifact server bound to {host or '*'!r}: devices need the URL they reach it at")
        self.public_url = public_url.rstrip("/") if public_url else None
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.httpd = ThreadingHTTPServer((host, port), lambda *a: handler(*a, directory=str(self.root)))
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="artifacts", daemon=True)

    @property
    def base_url(self) -> str:
        if self.public_url:
            return self.public_url
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "ArtifactServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def publish_dir(self, bundle: Path, name: str) -> str:
        """Copy a bundle under root/name (atomically) and return its URL prefix."""
        dest = self.root / name
        tmp, old = self.root / f".{name}.tmp", self.root / f".{name}.old"
        for d in (tmp, old):
            shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(bundle, tmp)
        # on disk before it is offered; the live copy moves aside rather than being deleted under readers
        durable.replace_tree(tmp, dest, old)
        return f"{self.base_url}/{name}"
