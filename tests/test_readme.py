"""The README's "Running it" commands, run in order as a user pastes them into one shell: in a scratch
directory, with Mosquitto started by the README's own line, each command bounded in time. The commands are
read out of the README's first code block under "## Running it", so the test breaks when the README drifts.

Substituted, and nothing else: the ports (1883, 8090) by free ones; `/tmp/` by the scratch directory;
`.venv/bin/` by this interpreter's; the bundled GGUF's path by the one this machine cached; the checkout's
`systemd/` and `quantize/` files by their paths in the checkout. The `edge-quantize build` lines are parsed by
edge-quantize itself and their bundles built the quick way at the paths they name (GPTQ takes minutes: the
INT4 one keeps the GGUF's own Q4_1 blocks, neither runs a calibration or an evaluation); every other line runs
as written. A line ending in `&` runs in the background, as in the shell; the README's last line stops those,
and the test makes sure they ended cleanly. The lines under "On a box installed by systemd/install.sh" need
systemd and the installed unit: they are in a block of their own, which is not run.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from broker import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COMMAND_TIMEOUT_S = 150  # the longest line: `deploy --wait` (download, verify, health check, swap)
CRASH_SIGNS = ("Traceback", "internal error", "Fatal Python error")

pytestmark = pytest.mark.real_model


def running_it_commands(readme: str) -> list[str]:
    """The commands of the first ```sh block under "## Running it": continuation lines joined, comments and
    blank lines left out."""
    section = readme.split("\n## Running it\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("\n```", 1)[0]
    commands, pending = [], ""
    for line in block.splitlines():
        line = pending + line
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        pending = ""
        command = strip_comment(line).strip()
        if command:
            commands.append(command)
    return commands


def strip_comment(line: str) -> str:
    """The line without a shell comment: a # at the start of a word, outside quotes."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def substitute(command: str, scratch: Path, ports: dict[int, int], gguf: Path) -> str:
    for readme_port, port in ports.items():
        command = re.sub(rf"\b{readme_port}\b", str(port), command)
    command = command.replace("~/.cache/edge-llm/models/SmolLM2-135M-Instruct.Q4_1.gguf", str(gguf))
    command = command.replace(".venv/bin/", f"{BIN}/").replace("/tmp/", f"{scratch}/")
    return re.sub(r"(?<![\w/.-])((?:systemd|quantize)/)", rf"{REPO}/\1", command)


class Shell:
    """One bash fed the commands one by one, as a terminal would; each command's output goes to a file."""

    def __init__(self, cwd: Path, logs: Path):
        self.logs = logs
        logs.mkdir()
        env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}:/usr/sbin:/sbin"}
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its own process group: stoppable all at once
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        self.background: dict[int, int] = {}  # command number -> pid

    def run(self, n: int, command: str, timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int, str]:
        """Run command number n; (its exit status, its output). A background one's status is 0 once started."""
        log = self.logs / f"{n}.log"
        if command.endswith("&") and not command.endswith("&&"):
            self.proc.stdin.write(f"{command[:-1]} > {log} 2>&1 & echo \"@@{n} $!\"\n")
        else:
            self.proc.stdin.write(f"{{ {command}\n}} > {log} 2>&1; echo \"@@{n} $?\"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"command {n} did not end within {timeout_s} s: {command}\n"
                                     f"{log.read_text()[-3000:] if log.exists() else ''}") from None
            if line.startswith(f"@@{n} "):
                value = int(line.split()[1])
                break
        if command.endswith("&"):
            self.background[n] = value
            return 0, ""
        return value, log.read_text()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left of the group
        except ProcessLookupError:
            pass


def build_quickly(command: str, scratch: Path, checkpoint) -> Path:
    """An `edge-quantize build` line: its options parsed by edge-quantize, its bundle built without GPTQ."""
    from quantize.cli import _name_of, build
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    params = build.make_context("build", shlex.split(command)[2:]).params
    spec = QuantSpec(precision=params["precision"], keep_source_quant=params["precision"] == "int4")
    out = scratch / params["out"]
    build_bundle(checkpoint, spec, out, name=_name_of(params["source"]), progress=lambda s: None)
    return out


def expected_output(command: str, fp32_version: str) -> str | None:
    """What a line's output must hold (beyond exit status 0), by what it runs."""
    for words, expected in (("edge-quantize inspect", "precision  int4"), ("edge-quantize eval", '"mean_kl"'),
                            ("agent/health", '"status"'), ("/v1/chat/completions", '"choices"'),
                            ("check-config", ": ok"), ("edge-fleet devices", "box-1"), (" ping ", '"pong": true'),
                            ("edge-fleet deploy", ": SUCCEEDED"), ("edge-fleet tps", "@"),
                            ("edge-fleet rollback", f"box-1 serves smollm2-135m-instruct@{fp32_version}"),
                            ("edge-fleet report", "wrote")):
        if words in command:
            return expected
    return None


def test_the_readme_commands_run_in_order(tmp_path, real_gguf, real_checkpoint):
    commands = running_it_commands((REPO / "README.md").read_text())
    assert commands[-1].startswith("kill $(jobs -p)") and any(c.startswith("mosquitto ") for c in commands)
    ports = {1883: free_port(), 8090: free_port()}
    shell = Shell(tmp_path, tmp_path / ".logs")
    started = time.monotonic()
    fp32_version = None
    try:
        for n, readme_line in enumerate(commands):
            command = substitute(readme_line, tmp_path, ports, real_gguf)
            if readme_line.startswith(".venv/bin/edge-quantize build "):
                out = build_quickly(command, tmp_path, real_checkpoint)
                if "fp32" in out.name:
                    fp32_version = json.loads((out / "manifest.json").read_text())["version"]
                continue
            status, output = shell.run(n, command)
            assert status == 0, f"README line failed ({status}): {readme_line}\n{output[-3000:]}"
            expected = expected_output(command, fp32_version)
            assert expected is None or expected in output, f"{readme_line}: no {expected!r} in\n{output[-3000:]}"
        for n, pid in shell.background.items():  # stopped by the README's last line, cleanly
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
                assert time.monotonic() < deadline, f"background command {n} ({commands[n]}) did not stop"
                time.sleep(0.1)
            log = (tmp_path / ".logs" / f"{n}.log").read_text()
            assert not any(s in log for s in CRASH_SIGNS), f"{commands[n]}:\n{log[-3000:]}"
    finally:
        shell.close()
    assert (tmp_path / "report.html").stat().st_size > 1000
    print(f"README's Running it: {len(commands)} commands in {time.monotonic() - started:.0f} s")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
