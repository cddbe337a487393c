"""A real Mosquitto broker for tests: started on a free loopback port, stoppable and restartable.

Persistence is on (a data directory per broker), so QoS 1 sessions and retained messages survive a
restart as they would in production.
"""
from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import time
from pathlib import Path


def mosquitto_binary() -> str:
    path = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(path).exists():
        raise RuntimeError("mosquitto is not installed (run .ci/setup)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    def __init__(self, workdir: Path, port: int | None = None, extra_config: str = ""):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.config = self.workdir / "mosquitto.conf"
        self.config.write_text(
            # as root, mosquitto drops to the `mosquitto` user, which could not write this directory: stay us
            f"user {getpass.getuser()}\n"
            f"listener {self.port} 127.0.0.1\n"
            "set_tcp_nodelay true\n"  # without it a command round trip took ~87 ms instead of ~1 ms
            f"persistence true\npersistence_location {self.workdir}/\n"
            "autosave_interval 1\n"
            f"log_dest file {self.workdir}/mosquitto.log\n"
            + (extra_config or "allow_anonymous true\n"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> "Broker":
        self.proc = subprocess.Popen([mosquitto_binary(), "-c", str(self.config)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mosquitto exited: see {self.workdir}/mosquitto.log")
                time.sleep(0.05)
        raise RuntimeError("mosquitto did not start listening")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


def dynamic_security_plugin() -> str:
    found = sorted(Path("/usr/lib").glob("*/mosquitto_dynamic_security.so")) + sorted(
        Path("/usr/lib").glob("mosquitto_dynamic_security.so"))
    if not found:
        raise RuntimeError("mosquitto's dynamic-security plugin is not installed (run .ci/setup)")
    return str(found[0])


def acl_denying_broker(workdir: Path, users: dict[str, str], publish: dict[str, list[str]],
                       subscribe: dict[str, list[str]]) -> Broker:
    """A started broker whose access control refuses out loud: Mosquitto's dynamic-security plugin answers a
    denied SUBSCRIBE with SUBACK 0x87 (an acl_file grants it and then delivers nothing) and a denied PUBLISH
    with PUBACK 0x87. users: name -> password (each its own client id); publish / subscribe: name -> the
    topic patterns it may use. Everything else is denied."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "dynsec.json"
    subprocess.run(["mosquitto_ctrl", "dynsec", "init", str(config), "admin", "admin-pw"], check=True,
                   capture_output=True)
    broker = Broker(workdir / "broker", extra_config=(f"allow_anonymous false\nplugin {dynamic_security_plugin()}\n"
                                                      f"plugin_opt_config_file {config}\n")).start()

    def ctrl(*args: str) -> None:
        subprocess.run(["mosquitto_ctrl", "-h", "127.0.0.1", "-p", str(broker.port), "-u", "admin", "-P", "admin-pw",
                        "dynsec", *args], check=True, capture_output=True)

    for user, password in users.items():
        ctrl("createClient", user, "-c", user, "-p", password)
        ctrl("createRole", f"role-{user}")
        ctrl("addClientRole", user, f"role-{user}")
        for pattern in publish.get(user, []):
            ctrl("addRoleACL", f"role-{user}", "publishClientSend", pattern, "allow")
        for pattern in subscribe.get(user, []):
            ctrl("addRoleACL", f"role-{user}", "subscribePattern", pattern, "allow")
    return broker
