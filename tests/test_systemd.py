"""The systemd units verify and rate well, ONNX Runtime runs under MemoryDenyWriteExecute, and the
sd_notify watchdog is fed by the engine loop itself (it stops when the loop stalls)."""
from __future__ import annotations

import gc
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.service.sdnotify import Notifier
from quantize.package import build_bundle
from quantize.precision import QuantSpec

UNITS = Path(__file__).parent.parent / "systemd"
VENV_BIN = Path(sys.executable).parent

def installed_copy(unit: str, tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's venv (verify checks the binary exists)."""
    text = (UNITS / unit).read_text().replace("/opt/edge-llm/venv/bin/", f"{VENV_BIN}/")
    out = tmp_path / unit
    out.write_text(text)
    return out


@pytest.mark.parametrize("unit", ["edge-agent.service", "edge-fleet.service"])
def test_units_verify(unit, tmp_path):
    r = subprocess.run(["systemd-analyze", "verify", str(installed_copy(unit, tmp_path))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr


@pytest.mark.parametrize("unit", ["edge-agent.service", "edge-fleet.service"])
def test_units_security_rating_at_most_2_5(unit, tmp_path):
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", str(installed_copy(unit, tmp_path))],
                       capture_output=True, text=True)
    line = next(l for l in r.stdout.splitlines() if "Overall exposure level" in l)
    score = float(line.split(":")[1].split()[0])
    print(f"{unit}: {score}")
    assert score <= 2.5


MDWE_SCRIPT = """
import ctypes, mmap, sys
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(65, 1, 0, 0, 0) == 0, "PR_SET_MDWE unsupported"   # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit("W+X mapping was allowed: the restriction is not in force")
except OSError:
    pass
from agent.engine.bundle import open_bundle
from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine.sampling_params import SamplingParams
e = Engine(open_bundle(sys.argv[1]), EngineConfig(threads=2, memory_budget_mb=4000, min_context=64))
r = e.generate(list(range(5, 20)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(r.figures.completion_tokens)
"""


@pytest.fixture(scope="module")
def tiny_bundle(tiny_checkpoint, tmp_path_factory):
    return build_bundle(tiny_checkpoint, QuantSpec(precision="int4", method="rtn", block_size=16, block_sizes={}),
                        tmp_path_factory.mktemp("sd") / "int4", name="tiny", progress=lambda s: None)


def test_onnxruntime_generates_under_memory_deny_write_execute(tiny_bundle):
    """The kernel's PR_SET_MDWE is what MemoryDenyWriteExecute= enforces: no W+X mappings, ever."""
    r = subprocess.run([sys.executable, "-c", MDWE_SCRIPT, str(tiny_bundle.path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "8"


class NotifyListener:
    """A real datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while not self._stop:
            try:
                data = self.sock.recv(4096)  # then the time: the tuple's order read the clock before waiting
                self.messages.append((time.monotonic(), data.decode()))
            except OSError:
                continue

    def pings_between(self, t0: float, t1: float) -> int:
        return sum(1 for t, m in self.messages if t0 <= t < t1 and "WATCHDOG=1" in m)

    def close(self):
        self._stop = True
        self.thread.join()
        self.sock.close()


def test_watchdog_pings_while_healthy_and_stop_when_the_loop_stalls(tiny_bundle, tmp_path):
    listener = NotifyListener(tmp_path / "notify")
    notifier = Notifier(str(tmp_path / "notify"), watchdog_usec=200_000)  # ping every 0.1 s
    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64),
                    heartbeat=notifier.heartbeat, idle_wait_s=0.05)
    engine.start()
    t0 = time.monotonic()
    time.sleep(1.0)
    healthy = listener.pings_between(t0, time.monotonic())
    stall = threading.Event()
    real_step = engine.step
    engine.step = lambda: stall.wait() or real_step()  # the loop blocks inside a step, as a hung kernel would
    time.sleep(0.7)  # let the loop enter the stalled step
    t1 = time.monotonic()
    time.sleep(1.0)
    stalled = listener.pings_between(t1, time.monotonic())
    stall.set()
    engine.stop()
    listener.close()
    assert healthy >= 5 and stalled == 0


def test_the_watchdog_is_fed_through_a_model_switch_for_a_bounded_time(tiny_bundle, tmp_path, monkeypatch):
    """Found in review: no engine loop runs between the old model's stop and the new one's start (the health
    check and the load: 4.6 s for SmolLM2 on x86, past WatchdogSec=30 for a larger model on a small box), so
    systemd would kill an update midway. A helper pings meanwhile, for at most SWITCH_KEEPALIVE_S."""
    import agent.service.lifecycle as lifecycle
    from agent.api.backend import Backend
    from agent.service.lifecycle import ModelLifecycle, load_engine

    listener = NotifyListener(tmp_path / "notify")
    notifier = Notifier(str(tmp_path / "notify"), watchdog_usec=200_000)  # ping every 0.1 s
    config = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64)
    backend = Backend(tiny_bundle.manifest)
    backend.mark_ready(load_engine(tiny_bundle.path, config, notifier))
    monkeypatch.setattr(lifecycle, "SWITCH_KEEPALIVE_S", 1.5)
    checked = []

    def slow_check(bundle):  # a long health check: no engine runs now
        checked.append(time.monotonic())
        time.sleep(3.0)

    # The swap's heap trim runs a full gc.collect(), which holds the GIL while it walks every tracked object: in
    # a test process holding the whole suite's objects that took over a second (no ping at all in the window),
    # where an agent holds its own. Frozen, this process's objects are left out of that walk.
    gc.collect()
    gc.freeze()
    t0 = time.monotonic()
    try:
        ModelLifecycle(backend, config, notifier).swap(tiny_bundle, slow_check)
    finally:
        gc.unfreeze()
    assert checked  # and the check alone took 3 s: no engine ran in either window
    fed, unfed = listener.pings_between(t0 + 0.2, t0 + 1.2), listener.pings_between(t0 + 1.9, t0 + 2.9)
    backend.engine.stop()
    listener.close()
    assert fed >= 3 and unfed == 0, (fed, unfed)


def test_the_switch_keepalive_pings_as_it_begins(tmp_path):
    """Found in review of the keepalive: its first ping came one interval in, and the engine's last one could be
    nearly an interval old already, a gap as long as WatchdogSec."""
    listener = NotifyListener(tmp_path / "notify")
    notifier = Notifier(str(tmp_path / "notify"), watchdog_usec=20_000_000)  # an interval of 10 s
    t0 = time.monotonic()
    with notifier.keepalive(60.0):
        time.sleep(0.3)
    time.sleep(0.2)
    pings = listener.pings_between(t0, time.monotonic())
    listener.close()
    assert pings == 1


def test_serve_speaks_sd_notify_ready_then_stopping_and_exits_0_on_sigterm(tiny_bundle, tmp_path):
    """edge-agent serve under a fake systemd: READY after load, WATCHDOG pings, STOPPING at SIGTERM, exit 0."""
    import signal as sig

    listener = NotifyListener(tmp_path / "notify")
    sock = tmp_path / "agent.sock"
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "400000", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([str(VENV_BIN / "edge-agent"), "serve", "--model", str(tiny_bundle.path),
                             "--socket", str(sock), "--memory-budget-mb", "4000", "--state-dir", str(tmp_path / "state")],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any("READY=1" in m for _, m in listener.messages):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.05)
        assert sock.exists()  # the socket listened before READY
        time.sleep(1.0)
        proc.send_signal(sig.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    messages = [m for _, m in listener.messages]
    ready = next(i for i, m in enumerate(messages) if "READY=1" in m)
    stopping = next(i for i, m in enumerate(messages) if "STOPPING=1" in m)
    assert ready < stopping
    assert sum("WATCHDOG=1" in m for m in messages[ready:stopping]) >= 3
    assert not sock.exists()


@pytest.mark.parametrize("unit", ["edge-agent.service", "edge-fleet.service"])
def test_the_units_command_lines_are_ones_their_programs_accept(unit):
    """Found in review: edge-fleet.service passed `serve --config`, an option edge-fleet serve does not have."""
    import shlex

    exec_start = next(l for l in (UNITS / unit).read_text().splitlines() if l.startswith("ExecStart="))
    program, *args = shlex.split(exec_start.removeprefix("ExecStart="))
    # click parses every option before it acts on --help: an unknown one is an error even here
    r = subprocess.run([VENV_BIN / Path(program).name, *args, "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_fleet_service_reads_its_options_from_the_shipped_environment_file(tmp_path):
    env = {}
    for line in (UNITS / "fleet.env").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    assert {"EDGE_FLEET_MQTT", "EDGE_FLEET_USERNAME", "EDGE_FLEET_PASSWORD_FILE", "EDGE_FLEET_SERVE_CLIENT_ID"} <= set(env)
    assert "EnvironmentFile=/etc/edge-fleet/fleet.env" in (UNITS / "edge-fleet.service").read_text()
    # the password file does not exist here: the error names it, so the variable was read as --password-file
    r = subprocess.run([VENV_BIN / "edge-fleet", "serve", "--db", str(tmp_path / "f.db")], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", **env}, timeout=60)
    assert r.returncode != 0 and "/etc/edge-fleet/mqtt.password" in r.stderr, r.stderr


def test_the_shipped_unit_gives_the_socket_its_group_without_a_chown():
    """Found in review: agent.toml asked for socket_group, which the agent (not in that group, no capabilities,
    @privileged filtered, PrivateUsers=) could never chown to: every start failed. The unit's Group= is now
    the socket's group, its runtime directory lets that group through, and its state stays the agent's."""
    import configparser
    import tomllib

    from agent.config import AgentConfig

    config = AgentConfig.model_validate(tomllib.loads((UNITS / "agent.toml").read_text()))
    assert config.api.socket_group is None and config.api.socket_mode & 0o060 == 0o060
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string((UNITS / "edge-agent.service").read_text())
    service = unit["Service"]
    assert service["Group"] == "edge-llm-clients" and "g     edge-llm-clients" in (UNITS / "sysusers.d" / "edge-llm.conf").read_text()
    assert int(service["RuntimeDirectoryMode"], 8) & 0o010 and service["StateDirectoryMode"] == "0700"
    assert "IPAddressDeny" not in service  # the fleet broker and artifact server are not on localhost


def test_the_shipped_broker_config_loads_beside_the_distributions_own(tmp_path):
    """Found in review: installed as the README says (conf.d beside Debian's stock mosquitto.conf, which sets
    persistence_location), its second persistence_location stopped Mosquitto at start."""
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "edge.conf").write_text((UNITS / "mosquitto" / "mosquitto.conf").read_text())
    stock = tmp_path / "mosquitto.conf"  # Debian's, Ubuntu's and Raspberry Pi OS's, paths moved here
    stock.write_text(f"pid_file {tmp_path}/pid\npersistence true\npersistence_location {tmp_path}/\n"
                     f"log_dest stderr\ninclude_dir {tmp_path}/conf.d\n")
    try:
        out = subprocess.run(["mosquitto", "-c", str(stock)], capture_output=True, text=True, timeout=3)
        text = out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:  # it started (the certificate paths are the box's, not here)
        text = (e.stdout or b"").decode() + (e.stderr or b"").decode()
    assert "Loading config file" in text and "Error found at" not in text and "Duplicate" not in text, text


def test_logs_to_journald_carry_their_priority_and_no_time_stamp(tmp_path):
    """Found in review: journald took every line as priority info (`journalctl -p warning` showed nothing)
    and the fleet's lines carried a second time stamp. Under journald ($JOURNAL_STREAM names stderr) each line
    starts with its sd-daemon priority; elsewhere lines are as before."""
    import os

    script = ("import logging; from agent.clikit import setup_logging; setup_logging(logging.INFO, timestamps=True);"
              "log = logging.getLogger('x'); log.info('ready'); log.warning('careful'); log.error('two\\nlines')")
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        st = os.fstat(f.fileno())
        env = os.environ | {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        subprocess.run([sys.executable, "-c", script], stderr=f, env=env, check=True, timeout=60)
    assert err.read_text().splitlines() == ["<6>INFO x: ready", "<4>WARNING x: careful", "<3>ERROR x: two",
                                            "<3>lines"]
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    first = out.stderr.splitlines()[0]
    assert first.endswith("INFO x: ready") and first[:4].isdigit(), out.stderr  # "2026-12-05 10:20:01,123 INFO ..."
