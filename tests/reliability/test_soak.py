"""Soak under load: 16 concurrent clients for 3 minutes against one agent (the real SmolLM2, INT4) whose
memory budget holds only a few sequences. Every request is answered or refused as "overloaded" (429 with
Retry-After), never a 500 or a broken stream; the process's peak RSS (the kernel's VmHWM) stays under the
budget; and telemetry.db holds exactly one row per answered request."""
from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import httpx
import pytest

from processes import Agent, client, integrity, rows

pytestmark = pytest.mark.real_model

CLIENTS = 16
SOAK_S = 180.0
BUDGET_MB = 420  # 334 MB of model and runtime: about 1,900 tokens of KV, so 16 clients must queue
SYSTEM = ("You are a concise assistant on a small edge device. Answer in one or two sentences, plainly, "
          "without lists or headings, and say so when you do not know.")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name three primary colours.",
             "What does a CPU do?", "Give me a synonym for quick.", "How many legs does a spider have?",
             "What is rain made of?", "Summarize: the cat sat on the mat and then it slept all day long."]


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.failures: list[str] = []

    def add(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if outcome == "failed":
                self.failures.append(detail)


def one_request(c: httpx.Client, rng: random.Random, tally: Tally) -> float:
    """Send one random request; the seconds to wait before the next (Retry-After when refused)."""
    stream = rng.random() < 0.5
    body = {"model": "smollm2", "max_tokens": rng.randint(8, 96), "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rng.choice(QUESTIONS)}]}
    if rng.random() < 0.5:
        body |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.randint(0, 1000)}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code == 429:
            r.read()
            assert r.json()["error"]["code"] == "overloaded", r.text
            tally.add("overloaded")
            return float(r.headers["retry-after"])
        text = "".join(r.iter_text())
    if r.status_code != 200:
        tally.add("failed", f"{r.status_code}: {text[:200]}")
        return 0.0
    if stream:
        events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
        ok = events[-1] == "[DONE]" and finish[-1] in ("stop", "length")
    else:
        ok = json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
    tally.add("answered" if ok else "failed", text[-300:])
    return 0.0


def client_loop(agent: Agent, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    with client(agent.sock, timeout_s=120) as c:
        while time.monotonic() < deadline:
            try:
                time.sleep(min(one_request(c, rng, tally), 2.0))
            except Exception as e:  # noqa: BLE001 - a broken connection or body is a failure to report
                tally.add("failed", repr(e))


def test_sixteen_clients_for_three_minutes_inside_the_budget(real_q4_bundle, tmp_path, figures):
    config = tmp_path / "agent.toml"
    config.write_text("[engine]\nmax_queue = 8\nmax_queue_wait_s = 20\n[telemetry]\nsample_interval_s = 5\n")
    agent = Agent(tmp_path, "--model", real_q4_bundle.path, "--config", config, "--memory-budget-mb", BUDGET_MB)
    agent.start()
    tally, rss_kb = Tally(), []
    deadline = time.monotonic() + SOAK_S
    threads = [threading.Thread(target=client_loop, args=(agent, i, deadline, tally)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        rss_kb.append(agent.status("VmRSS"))
        time.sleep(0.25)
    peak_mb = agent.status("VmHWM") / 1024  # the kernel's high-water mark: nothing between samples is missed
    assert agent.stop() == 0, agent.log.read_text()[-3000:]

    assert not tally.failures, tally.failures[:5]
    answered, overloaded = tally.counts["answered"], tally.counts["overloaded"]
    assert answered > 100 and overloaded > 0  # the load did reach the queue's limit
    assert peak_mb <= BUDGET_MB, f"peak RSS {peak_mb:.0f} MB over the {BUDGET_MB} MB budget"
    db = agent.telemetry_db
    finished = dict(rows(db, "SELECT finish_reason, count(*) FROM requests GROUP BY finish_reason"))
    assert finished.get("stop", 0) + finished.get("length", 0) == answered
    # the other rows: requests that waited max_queue_wait_s in the queue and were then refused as overloaded
    assert set(finished) <= {"stop", "length", "error"} and finished.get("error", 0) <= overloaded
    assert integrity(db) == "ok"
    figures.append(f"soak: {CLIENTS} clients for {SOAK_S:.0f} s, {answered} answered, {overloaded} refused "
                   f"'overloaded', 0 failed; peak RSS {peak_mb:.0f} MB (budget {BUDGET_MB} MB, sampled max "
                   f"{max(rss_kb) / 1024:.0f}); telemetry rows: {answered} finished + {finished.get('error', 0)} "
                   "overloaded in the queue")
