"""A TCP proxy on loopback whose client-to-server direction carries at most a given number of bytes a second, or
nothing while frozen: an edge box's slow uplink (cellular, a weak Wi-Fi), or a link gone silent without closing,
where the connection stays open and data crawls or stops."""
from __future__ import annotations

import socket
import threading
import time


class SlowUplink:
    def __init__(self, target_port: int, up_bytes_per_s: int | None = None):
        self.target_port, self.rate = target_port, up_bytes_per_s
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.url = f"mqtt://127.0.0.1:{self.port}"
        self.connections = 0
        self._closing = threading.Event()
        self.frozen = threading.Event()  # set: the uplink passes nothing (what arrives waits), nothing closes
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.connections += 1
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, self.rate, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, rate: int | None, up: bool) -> None:
        try:
            while data := src.recv(max(1, rate // 20) if rate else 65536):  # 20 small reads a second
                if rate:
                    time.sleep(len(data) / rate)
                while up and self.frozen.is_set() and not self._closing.is_set():
                    time.sleep(0.02)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # one side closed: close both, as a real link's end would
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closing.set()
        self.server.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass
