"""Runner: dropping clean weight-file pages and freed KV pages loses nothing; spinning is chosen by measurement."""
from __future__ import annotations

import gc
import mmap
import os
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from agent.engine.runner import choose_spinning, open_runner
from agent.process import (clean_file_mappings, cpu_busy_elsewhere, lazy_zeros, release_clean_file_pages, release_pages,
                           usable_cores)


def test_release_pages_gives_back_whole_pages_as_zeros():
    buf = lazy_zeros((4, 1024))  # 4 pages of float32
    buf[:] = 1.0
    release_pages(buf[1:3])
    assert buf[0].all() and buf[3].all() and not buf[1:3].any()


def test_clean_file_pages_are_dropped_and_read_back_modified_mappings_are_kept(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, 8 * mmap.PAGESIZE, dtype=np.uint8).tobytes()
    (tmp_path / "clean.bin").write_bytes(data)
    (tmp_path / "dirty.bin").write_bytes(data)
    with open(tmp_path / "clean.bin", "rb") as f1, open(tmp_path / "dirty.bin", "rb") as f2:
        clean = mmap.mmap(f1.fileno(), 0, access=mmap.ACCESS_COPY)  # MAP_PRIVATE, as ONNX Runtime maps weights
        dirty = mmap.mmap(f2.fileno(), 0, access=mmap.ACCESS_COPY)
    assert clean[:] == data  # every page now resident
    dirty[:] = data
    dirty[0] = data[0] ^ 0xFF  # one copy-on-write page: that mapping must not be dropped
    released = release_clean_file_pages(tmp_path)
    assert released == len(data)  # the clean mapping only
    assert clean[:] == data and dirty[0] == data[0] ^ 0xFF and dirty[1:] == data[1:]


def test_a_step_leaves_none_of_the_weight_files_resident(real_q4_bundle):
    """The embedding table's rows a step gathered are dropped after it: without that, 240 distinct tokens made
    ~29 MB of the table resident (the kernel maps 64 kB around each row), as months of requests would."""
    runner = open_runner(real_q4_bundle, 1, False)
    directory = runner.model_path.resolve().parent
    cache = runner.new_cache(1, 256)
    ids = np.arange(240)[None, :] * 200 + 100  # rows spread over the 49,152-token table
    for _ in range(2):  # the second run reads back what the first dropped
        logits = runner.forward(ids, np.array([239]), np.array([240]), np.array([[239]]), cache)
        # what stays is the norms' small mappings that every step reads (~0.4 MB, bounded)
        assert sum(rss for _, _, rss in clean_file_mappings(directory)) < 2 * 1024 * 1024
    assert np.isfinite(logits).all()
    other = open_runner(real_q4_bundle, 1, False)  # a second session on the same files records only its own mappings
    assert other._reread_weights and not set(other._reread_weights) & set(runner._reread_weights)
    other_logits = other.forward(ids, np.array([239]), np.array([240]), np.array([[239]]), other.new_cache(1, 256))
    assert np.array_equal(other_logits, logits)


def test_the_session_reads_its_weights_through_the_runners_own_mapping(real_q4_bundle):
    """ONNX Runtime maps no weight file of its own (the runner's mapping, used in place, is the only one), so the
    runner may drop its pages at any time, also while the session loads; logits match across sessions."""
    runner = open_runner(real_q4_bundle, 1, False)
    directory = runner.model_path.resolve().parent
    lo = runner._weights.ctypes.data
    mapped = (lo, lo - (-runner._weights.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)  # whole pages
    assert [(a, b) for a, b, _ in clean_file_mappings(directory)] == [mapped]
    assert runner._reread_weights == [mapped]
    ids = np.arange(100, 164)[None, :]
    logits = runner.forward(ids, np.array([63]), np.array([64]), np.array([[63]]), runner.new_cache(1, 128))
    again = open_runner(real_q4_bundle, 1, False).forward(ids, np.array([63]), np.array([64]), np.array([[63]]),
                                                          runner.new_cache(1, 128))
    assert np.isfinite(logits).all() and np.array_equal(logits, again)


def test_a_chunk_without_logits_fills_the_same_cache(real_q4_bundle):
    """A prompt chunk that is not the last asks for no logits ([1, 0, V]); the KV it writes, and so the logits
    of the chunk after it, are the same as when it computed them."""
    from agent.engine.kv_cache import KVPool
    from agent.engine.memory import SizeClass

    runner = open_runner(real_q4_bundle, 1, False)
    c = real_q4_bundle.config
    ids = list(range(300, 396))
    results = []
    for first_logits in (True, False):
        pool = KVPool([SizeClass(128, 1)], c.num_layers, c.num_kv_heads, c.head_dim).classes[0]
        pool.allocate(1)
        first = runner.forward_slot(pool, 0, ids[:64], 0, logits=first_logits)
        assert first.shape == (1, 1 if first_logits else 0, runner.vocab_size)
        results.append(runner.forward_slot(pool, 0, ids[64:], 64))
    assert np.array_equal(results[0], results[1])


def test_spinning_is_as_configured_unless_threads_outnumber_cores():
    assert choose_spinning(True, 1) and not choose_spinning(False, 1)
    assert not choose_spinning(True, usable_cores() + 1)


@pytest.fixture
def two_free_cores(monkeypatch):
    """choose_spinning as on a box with 2 cores and no CPU quota, whatever this one has."""
    import agent.engine.runner as runner_module

    monkeypatch.setattr(runner_module, "usable_cores", lambda: 2)
    monkeypatch.setattr(runner_module, "cpu_quota_cores", lambda: None)


def test_auto_does_not_spin_next_to_a_busy_neighbour(two_free_cores):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # inherits this process's CPUs
    try:
        time.sleep(0.3)  # let it start
        assert cpu_busy_elsewhere() > 0.5
        assert not choose_spinning("auto", 2)
    finally:
        hog.kill()
        hog.wait()


def test_recheck_rebuilds_the_session_when_the_box_got_busy(tiny_fp32_bundle):
    runner = open_runner(tiny_fp32_bundle, 2, "auto")
    cache = runner.new_cache(1, 32)
    ids, seqlens, q, last = np.array([[5, 6, 7]]), np.array([2]), np.array([3]), np.array([[2]])
    before = runner.forward(ids, seqlens, q, last, cache).copy()
    runner.spinning = True  # as if the box had been idle at start
    old = weakref.ref(runner.session)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert runner.recheck_spinning() and not runner.spinning
    finally:
        hog.kill()
        hog.wait()
    gc.collect()
    assert old() is None  # the old session (and its weights) is gone, not held by the cache's binding
    assert np.array_equal(runner.forward(ids, seqlens, q, last, cache), before)  # same cache, new session
    assert not open_runner(tiny_fp32_bundle, 1, False).recheck_spinning()  # a fixed choice is never re-measured


def test_a_rebuild_gives_the_old_sessions_heap_back(real_q4_bundle, monkeypatch):
    """With the engine loaded on one thread and rebuilding on its own (as serve does), the old session's heap
    goes back to the OS instead of staying resident beside the new one's (~70 MB of SmolLM2's RSS)."""
    import threading

    import agent.engine.engine as engine_module
    import agent.engine.runner as runner_module
    from agent.config import EngineConfig
    from agent.engine.engine import Engine
    from agent.process import rss_bytes
    from agent.engine.sampling_params import SamplingParams

    monkeypatch.setattr(engine_module, "SPIN_RECHECK_S", 1e9)
    made: list[Engine] = []

    def load() -> None:  # serve's loader thread, which starts the engine thread and ends
        made.append(Engine(real_q4_bundle, EngineConfig(threads=1, memory_budget_mb=8192, max_context=1024,
                                                             spin_wait=False)))
        made[0].start()

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    e = made[0]
    work = lambda: [h.result() for h in [e.submit(list(range(10 + i, 60 + i)), SamplingParams(max_tokens=8))  # noqa: E731
                                         for i in range(4)]]
    work()
    before = rss_bytes()
    e.runner.spin_wait = "auto"  # and the box changed: the next idle moment rebuilds the session
    monkeypatch.setattr(runner_module, "choose_spinning", lambda *a: True)
    monkeypatch.setattr(engine_module, "SPIN_RECHECK_S", 0.0)
    deadline = time.monotonic() + 60
    while not e.runner.spinning and time.monotonic() < deadline:
        time.sleep(0.05)
    monkeypatch.setattr(engine_module, "SPIN_RECHECK_S", 1e9)
    work()
    grown_mb = (rss_bytes() - before) / 2**20
    e.stop()
    assert e.runner.spinning and grown_mb < 25, f"RSS grew {grown_mb:.0f} MB over one rebuild"


def test_auto_sleeps_when_proc_stat_is_hidden(tmp_path, monkeypatch, two_free_cores):
    import agent.process

    monkeypatch.setattr(agent.process, "PROC_STAT", tmp_path / "stat")  # as under systemd's ProcSubset=pid
    assert not choose_spinning("auto", 2)


def test_auto_sleeps_at_one_thread_and_under_any_quota_without_measuring(monkeypatch, caplog, two_free_cores):
    """"auto" never spins under a cgroup CPU quota, whatever the thread count, nor at 1 thread (no workers to
    spin, so a re-measurement that flipped would rebuild the session for nothing), and says why without
    measuring."""
    import agent.engine.runner as runner_module

    monkeypatch.setattr(runner_module, "cpu_busy_elsewhere", lambda: 0.0)  # an idle box: spinning, if measured
    assert choose_spinning("auto", 2)
    monkeypatch.setattr(runner_module, "cpu_busy_elsewhere", lambda: pytest.fail("measured"))
    caplog.set_level("INFO", "agent.engine.runner")
    assert not choose_spinning("auto", 1) and "1 thread(s): workers sleep: 1 thread, so no workers" in caplog.text
    monkeypatch.setattr(runner_module, "cpu_quota_cores", lambda: 2.0)  # CPUQuota=200%, as many as threads
    assert not choose_spinning("auto", 2) and "a cgroup CPU quota of 2.00 cores" in caplog.text


def fake_cgroups(tmp_path, monkeypatch, mounts: list[str], memberships: list[str]) -> Path:
    """A /proc/self with these mountinfo mounts ("fstype root options", mounted under tmp_path/mnt/<n>) and
    cgroup lines; returns the mounts' parent. Files are then written under it as the kernel shows them."""
    import agent.process

    proc, mnt = tmp_path / "proc", tmp_path / "mnt"
    proc.mkdir()
    lines = [f"{30 + i} 23 0:{40 + i} {m.split()[1]} {mnt / str(i)} rw,relatime - {m.split()[0]} {m.split()[0]} "
             f"{m.split()[2]}" for i, m in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(["22 1 8:1 / / rw - ext4 /dev/sda1 rw", *lines]) + "\n")
    (proc / "cgroup").write_text("\n".join(memberships) + "\n")
    monkeypatch.setattr(agent.process, "PROC_SELF", proc)
    return mnt


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_a_cgroup_v2_cpu_quota_caps_cores_and_stops_spinning(tmp_path, monkeypatch):
    import agent.process

    mnt = fake_cgroups(tmp_path, monkeypatch, ["cgroup2 / rw,nsdelegate"], ["0::/system.slice/edge-agent.service"])
    write(mnt / "0/system.slice/edge-agent.service/cpu.max", "150000 100000")  # CPUQuota=150%
    write(mnt / "0/system.slice/cpu.max", "max 100000")
    assert agent.process.cpu_quota_cores() == 1.5
    assert usable_cores() == 1
    assert not choose_spinning("auto", 2) and not choose_spinning(True, 2)


def test_cgroup_v1_quotas_and_memory_limits_count_too(tmp_path, monkeypatch):
    """On a cgroup v1 box (older distributions, Docker on them) a CPU quota and a memory limit count as on v2
    (unseen, they meant two spinning threads on half a core, a budget above the limit).
    Here cpu and cpuacct share a hierarchy that a container sees from its own cgroup down (root /docker/c1),
    memory's is mounted whole, and a hybrid system's unified hierarchy carries no controller."""
    import agent.process

    mnt = fake_cgroups(tmp_path, monkeypatch, ["cgroup /docker/c1 rw,cpu,cpuacct", "cgroup / rw,memory",
                                               "cgroup2 / rw"],
                       ["5:memory:/docker/c1", "4:cpu,cpuacct:/docker/c1", "0::/docker/c1"])
    write(mnt / "0/cpu.cfs_quota_us", "50000")  # --cpus=0.5
    write(mnt / "0/cpu.cfs_period_us", "100000")
    write(mnt / "1/docker/c1/memory.limit_in_bytes", str(512 << 20))
    write(mnt / "1/memory.limit_in_bytes", "9223372036854771712")  # v1's "no limit"
    assert agent.process.cpu_quota_cores() == 0.5 and usable_cores() == 1
    assert agent.process.memory_limit_bytes() == 512 << 20
    write(mnt / "0/cpu.cfs_quota_us", "250000")  # --cpus=2.5
    assert agent.process.cpu_quota_cores() == 2.5
    write(mnt / "0/cpu.cfs_quota_us", "-1")  # no quota
    assert agent.process.cpu_quota_cores() is None


def test_a_non_utf8_path_is_read_in_smaps_and_refused_by_name_for_a_bundle(tiny_fp32_bundle, tmp_path):
    """A mapped file whose name is not UTF-8 is read in smaps like any other (calibrating such a GGUF needs
    it), and a bundle at such a path is refused by name instead of a bare TypeError from ONNX Runtime."""
    from agent.engine.bundle import BundleError, open_bundle

    odd = tmp_path / os.fsdecode(b"caf\xe9")
    odd.mkdir()
    (odd / "data").write_bytes(b"\1" * 65536)
    with open(odd / "data", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[0] == 1
        assert [hi - lo for lo, hi, _ in clean_file_mappings(odd)] == [65536]
    shutil.copytree(tiny_fp32_bundle.path, odd / "bundle")
    with pytest.raises(BundleError, match="must be valid UTF-8"):
        open_bundle(odd / "bundle")


def test_onnx_runtime_keeps_no_telemetry_state_and_sends_nothing(tiny_fp32_bundle, tmp_path):
    """ONNX Runtime 1.29+ collects usage telemetry on Linux too, with a device id and an event database under
    $HOME/.cache/Microsoft (the agent's HOME is its state directory). Loading through the runner opts out
    before the runtime initializes."""
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"} | {"HOME": str(tmp_path)}
    script = ("import sys; from agent.engine.bundle import open_bundle; from agent.engine.runner import open_runner; "
              "open_runner(open_bundle(sys.argv[1]), 1)")
    r = subprocess.run([sys.executable, "-c", script, str(tiny_fp32_bundle.path)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / ".cache").exists(), sorted(str(p) for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("version,ok", [("1.31.1", False), ("1.22.0", False), ("1.32.0", True),
                                        ("1.33.0.dev20261201", True), ("2.0.0", True)])
def test_the_runtime_version_floor(version, ok):
    from agent.engine.runner import check_runtime_version

    if ok:
        check_runtime_version(version)
    else:
        with pytest.raises(ValueError, match=f"onnxruntime {version} is too old"):
            check_runtime_version(version)


@pytest.mark.parametrize("allowzero", [True, False])
def test_a_tied_fp32_head_takes_a_call_without_logits_old_graphs_by_a_fallback(tiny_fp32_bundle, tmp_path, allowzero):
    """The tied fp32 head's output Reshape takes allowzero, so [B, 0, V] is a shape and not "copy V"; a graph
    built before that fails a call without logits, and the runner asks it for the last row's from then on."""
    import onnx

    from agent.engine.bundle import Bundle
    from agent.engine.kv_cache import KVPool
    from agent.engine.memory import SizeClass

    bundle = tiny_fp32_bundle
    if not allowzero:  # as edge-quantize built it before: the attribute dropped
        shutil.copytree(bundle.path, tmp_path / "old")
        graph = onnx.load(str(tmp_path / "old" / "model.onnx"), load_external_data=False)
        node = next(n for n in graph.graph.node if n.name == "/lm_head/Reshape_out")
        assert [a.name for a in node.attribute] == ["allowzero"]
        del node.attribute[:]
        onnx.save(graph, str(tmp_path / "old" / "model.onnx"))
        bundle = Bundle(tmp_path / "old", None, bundle.config)
    runner, c = open_runner(bundle, 1, False), bundle.config
    ids, results = list(range(3, 40)), []
    for first_logits in (True, False):
        pool = KVPool([SizeClass(64, 1)], c.num_layers, c.num_kv_heads, c.head_dim).classes[0]
        pool.allocate(1)
        first = runner.forward_slot(pool, 0, ids[:20], 0, logits=first_logits)
        assert first.shape == (1, 1 if first_logits or not allowzero else 0, runner.vocab_size)
        results.append(runner.forward_slot(pool, 0, ids[20:], 20))
    assert np.array_equal(results[0], results[1]) and runner.logit_free_calls is allowzero
