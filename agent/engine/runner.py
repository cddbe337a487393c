"""The model runner: the only place on the device that imports onnxruntime.

One InferenceSession per model. Every step runs through IOBinding so that inputs, logits and the KV
cache are not copied: the cache's numpy buffers are bound as both `past_*` and `present_*`, and
GroupQueryAttention writes the new tokens' keys and values into them in place. Each cache keeps its
binding, so a step rebinds only the five small inputs and the logits, not the 4 x layers cache tensors.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import struct
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

# ONNX Runtime 1.29+ sends usage telemetry from Linux too, and keeps a device id and an event database under
# $HOME/.cache/Microsoft (3 MB here after two days; the agent's HOME is its state directory). A device serving
# local users must not call out on its own: this opt-out, read when the runtime initializes, turns it all off.
# A user who wants it sets ORT_DISABLE_TELEMETRY=0.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
import onnxruntime as ort  # noqa: E402  (after the opt-out above)

from agent import wire
from agent.engine.bundle import Bundle
from agent.engine.kv_cache import SlotPool
from agent.process import (clean_file_mappings, cpu_busy_elsewhere, cpu_quota_cores, drop_pages, lazy_zeros,
                           periodically, release_clean_file_pages, trim_heap, usable_cores)

# Our graphs give GroupQueryAttention its query_seqlens input (several new tokens on a ragged batch), which
# ONNX Runtime accepts from 1.32; older ones refuse every graph with a schema error naming input counts.
MIN_ORT_VERSION = (1, 32)

log = logging.getLogger(__name__)
SpinWait = bool | Literal["auto"]
# "auto" spins only when other processes used less than this many cores' worth of this process's CPUs
# while it measured: a spinner next to a busy neighbour lost 30-40% of decode speed (docs/benchmarks.md)
SPIN_MAX_BUSY_ELSEWHERE = 0.25


# Mapped weight files at least this large are dropped again after every step. A step still reads one:
# the embedding table (its Gather's; MatMulNBits prepacked the rest at load). Each token's row faults in
# 64 kB around it (the kernel maps neighbouring pages already in the page cache), so a 896-token prompt
# made ~16 MB of it resident, and months of varied requests would make all 27 MB resident, beyond what the
# memory budget measured at start. Smaller mappings are scales and norms that prepacking already consumed.
RELEASE_AFTER_STEP_MIN_BYTES = 1 << 20
# While a session loads, the weight file's pages are dropped this often. Prepacking reads every weight once from
# the mapping into ONNX Runtime's own buffers, and the pages it read would otherwise stay resident until the load
# returns: Gemma 3 270M's peak RSS carried its 168 MB tied table twice, the prepacked copy and the file pages.
DROP_WHILE_LOADING_S = 0.005


def choose_spinning(spin_wait: SpinWait, threads: int) -> bool:
    """Whether ONNX Runtime's workers spin. "auto" decides by measuring the box now (see session_options)."""
    cores = usable_cores()
    if threads > cores:  # more threads than cores: spinners starve each other
        return False
    if spin_wait != "auto":
        return bool(spin_wait)
    quota = cpu_quota_cores()
    # never spin under any cgroup CPU quota (whatever the thread count), nor at 1 thread: there are no workers
    # (the caller's thread runs every op), so a re-measurement that flipped the answer would rebuild the
    # session for nothing
    why = ("1 thread, so no workers" if threads == 1 else
           f"a cgroup CPU quota of {quota:.2f} cores is set (spinning would burn it)" if quota is not None else None)
    if why is not None:
        log.info("%d thread(s): workers sleep: %s", threads, why)
        return False
    try:
        busy = cpu_busy_elsewhere()
    except OSError as e:  # e.g. systemd's ProcSubset=pid hides /proc/stat
        log.warning("cannot measure other load (%s): workers will sleep; set spin_wait = true to spin", e)
        return False
    log.info("%d threads: others used %.2f cores of ours while measuring: workers will %s", threads, busy,
             "spin" if busy < SPIN_MAX_BUSY_ELSEWHERE else "sleep")
    return busy < SPIN_MAX_BUSY_ELSEWHERE


@dataclass(eq=False)  # identity semantics: the runner keeps a weak set of the caches it has bound
class KVCache:
    """Per-layer key/value buffers [batch, kv_heads, capacity, head_dim], updated in place by the graph."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    keys_ort: list[ort.OrtValue]
    values_ort: list[ort.OrtValue]
    # one IOBinding per session that has run on this cache, with the cache tensors already bound
    bindings: dict[int, tuple[ort.InferenceSession, ort.IOBinding]] = field(default_factory=dict, repr=False)
    # id(binding) -> the LoRA tensors bound on it (LoraTensors.values); absent: the graph's rank-0 defaults
    lora_bound: dict[int, dict[str, ort.OrtValue]] = field(default_factory=dict, repr=False)

    @classmethod
    def wrap(cls, keys: list[np.ndarray], values: list[np.ndarray]) -> "KVCache":
        """Wrap numpy buffers (or contiguous views of a pool) without copying them."""
        for a in keys + values:
            # ORT silently copies a non-contiguous array, and then the graph's writes never reach the pool
            if not a.flags.c_contiguous or a.dtype not in (np.float32, np.int8) or a.dtype != keys[0].dtype:
                raise ValueError("KV buffers must be C-contiguous float32 or int8, all of one type")
        as_ort = lambda arrs: [ort.OrtValue.ortvalue_from_numpy(a) for a in arrs]  # noqa: E731
        return cls(keys, values, as_ort(keys), as_ort(values))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)


@dataclass(frozen=True, eq=False)
class LoraTensors:
    """An adapter's tensors for every LoRA input of the graph, in memory of our own (not the adapter file's
    mapping: its bytes are counted in the budget whether or not a step has touched them yet)."""

    arrays: dict[str, np.ndarray]  # A [in, r], B [r, out], float32
    values: dict[str, ort.OrtValue] = field(repr=False)  # views of arrays, bound as graph inputs

    @classmethod
    def wrap(cls, arrays: dict[str, np.ndarray]) -> "LoraTensors":
        arrays = {k: np.ascontiguousarray(v, np.float32) for k, v in arrays.items()}
        return cls(arrays, {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in arrays.items()})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class ModelRunner:
    def __init__(self, model_path: Path, num_layers: int, kv_heads: int, head_dim: int, threads: int | None = None,
                 spin_wait: SpinWait = False, max_positions: int | None = None):
        """max_positions: the most positions a sequence will hold (None: the graph's context); the RoPE tables are
        cut to it (GroupQueryAttention refuses a step past them)."""
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_positions = max_positions
        self.model_path, self.threads, self.spin_wait = Path(model_path), threads or usable_cores(), spin_wait
        self._bound: weakref.WeakSet[KVCache] = weakref.WeakSet()  # caches holding a binding to the session
        # each pool's wrapped slot ranges: wrapping 2 x layers arrays costs microseconds, and a wrap keeps its binding
        self._views: weakref.WeakKeyDictionary[SlotPool, dict[tuple[int, int], KVCache]] = weakref.WeakKeyDictionary()
        self._weights: np.ndarray | None = None  # this session's own read-only mapping of the weight file
        self._load(choose_spinning(spin_wait, self.threads))
        self.vocab_size = next(o.shape[2] for o in self.session.get_outputs() if o.name == wire.LOGITS)
        self.logit_free_calls: bool | None = None  # whether the graph takes a call without logits (None: not tried)
        cache_type = next(i.type for i in self.session.get_inputs() if i.name == wire.past_key(0))
        self.kv_dtype = np.dtype(np.int8 if cache_type == "tensor(int8)" else np.float32)
        self.lora_defaults = LoraTensors.wrap(lora_defaults(self.session))  # {} for a graph without LoRA branches

    @property
    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """Each LoRA input's shape with rank 0: A [in, 0], B [0, out]."""
        return {k: a.shape for k, a in self.lora_defaults.arrays.items()}

    def _load(self, spin: bool) -> None:
        check_runtime_version(ort.__version__)
        directory = self.model_path.resolve().parent
        others = {(lo, hi) for lo, hi, _ in clean_file_mappings(directory)}  # e.g. a draft's session on this bundle
        opts = session_options(self.threads, spin)
        self._weights = map_weight_file(directory / wire.GRAPH_DATA, opts)
        # a graph given as bytes finds its external weights only among those given in memory (map_weight_file's)
        graph = (graph_for_positions(self.model_path, self.max_positions)
                 if self.max_positions and self._weights is not None else None)
        with dropping_pages(self._weights) if self._weights is not None else nullcontext():
            self.session = ort.InferenceSession(graph or str(self.model_path), opts, providers=["CPUExecutionProvider"])
        self.spinning = spin
        self.released_bytes = release_clean_file_pages(directory)
        # Only this session's own mappings: another's may be unmapped, and its range reused, while this one
        # runs. ONNX Runtime never writes an initializer after load, so they stay clean and dropping loses nothing.
        self._reread_weights = [(lo, hi) for lo, hi, _ in clean_file_mappings(directory)
                                if hi - lo >= RELEASE_AFTER_STEP_MIN_BYTES and (lo, hi) not in others]

    def recheck_spinning(self) -> bool:
        """With spin_wait "auto", call while idle: measure the box again and, if the answer changed, rebuild the
        session (ONNX Runtime fixes spinning when a session is made). Returns whether it rebuilt.

        A box busy at boot would otherwise sleep its workers for months, or one idle at boot spin next to a
        workload that arrived later.
        """
        if self.spin_wait != "auto":
            return False
        spin = choose_spinning("auto", self.threads)
        if spin == self.spinning:
            return False
        for cache in list(self._bound):
            cache.bindings.clear()  # they hold the old session
            cache.lora_bound.clear()
        # free the old weights before the new session prepacks its own (one copy at a time); their mappings go
        # with them, so nothing may drop pages there any more
        self.session, self._weights, self._reread_weights = None, None, []
        # ...and give their heap back to the OS: the old session's heap (made on the loader thread's malloc
        # arena) otherwise stays resident while the new one grows on the engine thread's, ~70 MB of SmolLM2's
        # RSS for good, past what the budget had measured
        trim_heap()
        try:
            self._load(spin)
        except Exception:  # e.g. out of memory mid-build: back to the session that worked (raises if that fails too)
            log.exception("rebuilding the session failed; keeping workers that %s", "spin" if not spin else "sleep")
            self._load(not spin)
            return False
        return True

    def warm_up(self, chunk_tokens: int, context: int) -> None:
        """Run the largest step once (a prefill chunk attending over the whole context), so that what it
        allocates is resident before the engine measures memory."""
        chunk = min(chunk_tokens, context)
        self.forward(np.zeros((1, chunk), np.int64), np.array([context - 1]), np.array([chunk]),
                     np.array([[chunk - 1]]), self.new_cache(1, context))

    def view(self, pool: SlotPool, lo: int, hi: int) -> KVCache:
        """The KV buffers of pool's slots [lo, hi) as one batch, wrapped once per pool and range."""
        views = self._views.setdefault(pool, {})
        key = (lo, hi)
        if key not in views:
            views[key] = KVCache.wrap([k[lo:hi] for k in pool.keys], [v[lo:hi] for v in pool.values])
        return views[key]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        keys = [lazy_zeros(shape, self.kv_dtype) for _ in range(self.num_layers)]
        values = [lazy_zeros(shape, self.kv_dtype) for _ in range(self.num_layers)]
        return KVCache.wrap(keys, values)

    def forward(self, input_ids: np.ndarray, seqlens_k: np.ndarray, query_seqlens: np.ndarray,
                logits_indices: np.ndarray, cache: KVCache, capture: dict[str, np.ndarray] | None = None,
                adapter: LoraTensors | None = None) -> np.ndarray:
        """Run one step. input_ids [B, S]; seqlens_k, query_seqlens [B]; logits_indices [B, n] -> logits [B, n, V].

        Row b holds query_seqlens[b] new tokens (right-padded to S) on top of
        seqlens_k[b] + 1 - query_seqlens[b] cached ones. `capture` maps extra graph outputs (a calibration
        graph's) to preallocated arrays that receive them. Every row runs with `adapter` (None: the base alone).
        """
        seq = input_ids.shape[1]
        feeds = {
            wire.INPUT_IDS: np.ascontiguousarray(input_ids, np.int64),
            wire.SEQLENS_K: np.ascontiguousarray(seqlens_k, np.int32),
            wire.TOTAL_SEQUENCE_LENGTH: np.array(max(int(seqlens_k.max()) + 1, seq), np.int32),
            wire.QUERY_SEQLENS: np.ascontiguousarray(query_seqlens, np.int32),
            wire.LOGITS_INDICES: np.ascontiguousarray(logits_indices, np.int64),
        }
        # a capture binds outputs a later plain step must not write into: it gets a binding of its own
        binding = self._bind_cache(self.session.io_binding(), cache) if capture else self._binding(cache)
        self._bind_lora(binding, {} if capture else cache.lora_bound, adapter)
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)  # references arr's memory; arr lives until run returns
        logits = np.empty((input_ids.shape[0], logits_indices.shape[1], self.vocab_size), np.float32)
        binding.bind_ortvalue_output(wire.LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        for name, array in (capture or {}).items():
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
        self.session.run_with_iobinding(binding)
        for lo, hi in self._reread_weights:
            drop_pages(lo, hi)
        return logits

    def _bind_lora(self, binding: ort.IOBinding, lora_bound: dict, adapter: LoraTensors | None) -> None:
        """Bind adapter's tensors (None: the rank-0 defaults) unless this binding holds them already (lora_bound:
        KVCache.lora_bound): a binding keeps its inputs between runs, and rebinding all 2 x 4 x layers LoRA
        inputs at every step costs time."""
        bound = lora_bound.get(id(binding))
        if (adapter.values if adapter else None) is bound:
            return
        for name, value in (adapter or self.lora_defaults).values.items():
            binding.bind_ortvalue_input(name, value)
        if adapter is None:
            lora_bound.pop(id(binding), None)
        else:
            lora_bound[id(binding)] = adapter.values

    def forward_slot(self, pool: SlotPool, slot: int, ids: list[int], start: int, logits: bool = True,
                     adapter: LoraTensors | None = None) -> np.ndarray:
        """Compute ids at positions start.. of one slot of pool (a prompt chunk, a draft model's catch-up or
        one-token step) -> the last token's logits [1, 1, V], or [1, 0, V] when logits is False.

        A chunk that is not a prompt's last needs only its KV: with no logits index the lm_head runs on no rows,
        which for Gemma 3's 262,144 x 640 head is a third of a decode step saved per chunk.
        """
        n = len(ids)
        args = (np.array([ids], np.int64), np.array([start + n - 1]), np.array([n]))
        if not logits and self.logit_free_calls is not False:
            try:
                out = self.forward(*args, np.zeros((1, 0), np.int64), self.view(pool, slot, slot + 1), adapter=adapter)
                self.logit_free_calls = True
                return out
            except RuntimeError:  # a tied fp32 head built before its output Reshape took allowzero: [B, 0, V]
                self.logit_free_calls = False  # failed there, after every layer wrote the same KV it writes again
        return self.forward(*args, np.array([[n - 1]]), self.view(pool, slot, slot + 1), adapter=adapter)

    def forward_decode(self, pool: SlotPool, runs: dict[int, tuple[int, list[int]]],
                       adapter: LoraTensors | None = None) -> np.ndarray:
        """One decode call over pool's live slots [0:n] -> logits [n, width, V], row i for the sequence in slot i.

        runs: sequence id -> (tokens already in its cache, the tokens to run: its last one and any draft). The
        batch is right-padded to the longest run (query_seqlens tells each row's length); a slot with no run
        (still prefilling) is an idle row, query_seqlens 0, that neither computes into nor changes its cache.
        """
        n, width = len(pool.owners), max(len(run) for _, run in runs.values())
        ids = np.zeros((n, width), np.int64)
        seqlens = np.zeros(n, np.int32)
        q = np.zeros(n, np.int32)
        for row, owner in enumerate(pool.owners):
            if owner in runs:
                cached, run = runs[owner]
                ids[row, :len(run)], seqlens[row], q[row] = run, cached + len(run) - 1, len(run)
            else:
                seqlens[row] = max(pool.lengths[owner] - 1, 0)
        positions = np.minimum(np.arange(width)[None, :], np.maximum(q, 1)[:, None] - 1)  # [n, width]
        return self.forward(ids, seqlens, q, positions, self.view(pool, 0, n), adapter=adapter)

    def _binding(self, cache: KVCache) -> ort.IOBinding:
        """This session's binding for cache, made (and its 4 x layers cache tensors bound) on first use."""
        held = cache.bindings.get(id(self.session))
        if held is None or held[0] is not self.session:
            binding = self._bind_cache(self.session.io_binding(), cache)
            # a new binding holds the rank-0 defaults, whatever one freed at its address held (recheck_spinning)
            cache.lora_bound.pop(id(binding), None)
            held = cache.bindings[id(self.session)] = (self.session, binding)
            self._bound.add(cache)
        return held[1]

    def _bind_cache(self, binding: ort.IOBinding, cache: KVCache) -> ort.IOBinding:
        for i in range(self.num_layers):
            binding.bind_ortvalue_input(wire.past_key(i), cache.keys_ort[i])
            binding.bind_ortvalue_input(wire.past_value(i), cache.values_ort[i])
            binding.bind_ortvalue_output(wire.present_key(i), cache.keys_ort[i])
            binding.bind_ortvalue_output(wire.present_value(i), cache.values_ort[i])
        return binding


def open_runner(bundle: Bundle, threads: int | None = None, spin_wait: SpinWait = False,
                kv_dtype: str = "fp32", max_positions: int | None = None) -> ModelRunner:
    """A runner for the bundle's graph that uses this KV cache type (BundleError if the bundle has none)."""
    c = bundle.config
    return ModelRunner(bundle.graph(kv_dtype), c.num_layers, c.num_kv_heads, c.head_dim, threads, spin_wait,
                       max_positions)


def graph_for_positions(path: Path, positions: int) -> bytes | None:
    """The graph's bytes with each RoPE table cut to `positions` rows (wire.ROPE_TABLE_LIMITS), or None when no
    table is longer (positions >= its limit, or a graph without such limits).

    ONNX Runtime folds each table to a constant held by the session: Gemma 3's two bases over its 32,768
    positions came to 64 MB, where a 1,024-token context needs 2. Each limit is a scalar float32 TensorProto as
    onnx serializes one: data_type (field 2) FLOAT, name (field 8), raw_data (field 9) of 4 bytes. Those 4
    bytes are replaced in place, so no length prefix around them changes; parsing the graph with the onnx
    package instead would cost the agent ~17 MB of imports for two numbers.
    """
    data = bytearray(path.read_bytes())
    changed = False
    for name in wire.ROPE_TABLE_LIMITS:
        key = name.encode()
        head = b"\x10\x01\x42" + bytes([len(key)]) + key + b"\x4a\x04"
        at = data.find(head)
        if at < 0 or data.find(head, at + 1) >= 0:  # absent, or not one unambiguous initializer: left as built
            continue
        lo = at + len(head)
        if positions < struct.unpack("<f", data[lo:lo + 4])[0]:
            data[lo:lo + 4] = struct.pack("<f", positions)
            changed = True
    return bytes(data) if changed else None


def map_weight_file(path: Path, opts: ort.SessionOptions) -> np.ndarray | None:
    """Map the graph's external weight file read-only and have the session use the mapping in place
    (session.use_external_initializer_file_buffers_directly): its pages are then ours to drop at any time, as
    no other mapping can take over their addresses while the returned array lives. It must outlive the
    session (the embedding's Gather reads the table through it). None when the graph has no such file."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        weights = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
    opts.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
    opts.add_external_initializers_from_files_in_memory([path.name], [weights], [weights.nbytes])
    return weights


def dropping_pages(weights: np.ndarray):
    """Drop weights' resident pages every DROP_WHILE_LOADING_S until the block ends (clean pages of a
    read-only file mapping: a read after a drop faults them back in from the page cache)."""
    lo = weights.ctypes.data

    def drop() -> None:  # a failed drop (drop_pages' False) is tried again at the next tick
        drop_pages(lo, lo + weights.nbytes)

    return periodically(DROP_WHILE_LOADING_S, drop, "drop-weight-pages")


def check_runtime_version(version: str) -> None:
    """ValueError, saying what to install, when ONNX Runtime is older than our graphs need (pip enforces the
    floor; a distribution's package or a --no-deps install does not)."""
    found = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if found < MIN_ORT_VERSION:
        need = ".".join(map(str, MIN_ORT_VERSION))
        raise ValueError(f"onnxruntime {version} is too old: edge-llm's graphs need {need} or newer "
                         f"(pip install 'onnxruntime>={need}')")


def session_options(threads: int, spin: bool = False) -> ort.SessionOptions:
    """CPU session options. spin: worker threads spin between kernels instead of sleeping.

    A decode step is ~300 small kernels and a sleeping worker is woken for each one: on an idle 2-core
    machine spinning made decode ~1.25x faster. But when other processes want the cores, a spinner
    waits on a partner the scheduler has descheduled, and decode was ~1.6x slower than sleeping
    (bench/tps.py, docs/benchmarks.md). A spinning worker keeps spinning for a bounded while after Run()
    returns, which bridges the engine's few hundred microseconds between steps: forcing the spin to stop
    at every return (session.force_spinning_stop) lost ~10% of decode speed (measured in separate
    processes, 3 rounds: ~118 vs ~131 tok/s on a loaded 2-core host). With one worker on two cores the
    engine thread keeps a core of its own meanwhile.
    """
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # errors only: an adapter-ready graph's LoRA inputs have initializer defaults on purpose (quantize.lora), and
    # ONNX Runtime warns about each at every load (240 lines for SmolLM2 on seven projections)
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    # A memory pattern reserves one block per distinct set of input shapes, and a batch's shapes change
    # step by step. Without patterns the arena reuses freed tensors: peak RSS at a 1,024-token context
    # fell by ~11 MB, with decode, TTFT-512 and 4-stream speed unchanged within noise
    # (fresh processes, 9 interleaved rounds; docs/benchmarks.md, what we tried).
    opts.enable_mem_pattern = False
    return opts


def write_adapter(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write named tensors (an adapter's LoRA inputs, agent.wire.lora_a / lora_b) in ONNX Runtime's adapter
    format (.onnx_adapter, a FlatBuffers file it memory-maps)."""
    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(wire.ADAPTER_SCHEMA_VERSION)
    adapter.set_model_version(wire.ADAPTER_SCHEMA_VERSION)
    # an OrtValue made from numpy borrows the array's memory without holding it: the contiguous copies must
    # outlive the export (a temporary one was freed first, and the file held whatever reused its memory)
    arrays = {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}
    adapter.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in arrays.items()})
    adapter.export_adapter(str(path))


def lora_defaults(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    """The graph's LoRA inputs at rank 0 (quantize.lora: initializers a run may override), by name."""
    # their declared shapes name the rank symbolically: A [in, "lora_rank_.."], B ["lora_rank_..", out]
    shapes = {i.name: i.shape for i in session.get_overridable_initializers()}
    return {name: np.zeros([d if isinstance(d, int) else 0 for d in shape], np.float32)
            for name, shape in shapes.items() if name.endswith((".lora_A", ".lora_B"))}


def read_adapter_arrays(path: Path) -> dict[str, np.ndarray]:
    """An adapter file's tensors by name, copied out of its mapping (LoraTensors.wrap them to bind)."""
    return {name: np.array(value.numpy()) for name, value in read_adapter(path).items()}


def read_adapter(path: Path) -> dict[str, ort.OrtValue]:
    """An adapter file's tensors by name, as views of the mapped file. Bind them as graph inputs: an adapter
    made active through RunOptions (add_active_adapter) has no effect on run_with_iobinding, which every step
    here uses (ONNX Runtime says so, and warns)."""
    return ort.AdapterFormat.read_adapter(str(path)).get_parameters()
