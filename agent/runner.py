"""The model runner: the only place on the device that imports onnxruntime.

One InferenceSession per model. Every step runs through IOBinding so that inputs, logits and the KV
cache are not copied: the cache's numpy buffers are bound as both `past_*` and `present_*`, and
GroupQueryAttention writes the new tokens' keys and values into them in place.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from agent import wire


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota if one is set."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 CPU controller visible: affinity is the limit
    return max(1, cores)


@dataclass
class KVCache:
    """Per-layer key/value buffers [batch, kv_heads, capacity, head_dim], updated in place by the graph."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    keys_ort: list[ort.OrtValue]
    values_ort: list[ort.OrtValue]

    @classmethod
    def wrap(cls, keys: list[np.ndarray], values: list[np.ndarray]) -> "KVCache":
        """Wrap numpy buffers (or contiguous views of a pool) without copying them."""
        for a in keys + values:
            # ORT silently copies a non-contiguous array, and then the graph's writes never reach the pool
            if not a.flags.c_contiguous or a.dtype != np.float32:
                raise ValueError("KV buffers must be C-contiguous float32")
        as_ort = lambda arrs: [ort.OrtValue.ortvalue_from_numpy(a) for a in arrs]  # noqa: E731
        return cls(keys, values, as_ort(keys), as_ort(values))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)


class ModelRunner:
    def __init__(self, model_path: Path, num_layers: int, kv_heads: int, head_dim: int, threads: int | None = None):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads or usable_cores()
        opts.inter_op_num_threads = 1
        # Spin-waiting halved decode speed with 2 threads on a loaded machine; sleeping threads restore it.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        self.vocab_size = next(o.shape[2] for o in self.session.get_outputs() if o.name == wire.LOGITS)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        keys = [np.zeros(shape, np.float32) for _ in range(self.num_layers)]
        values = [np.zeros(shape, np.float32) for _ in range(self.num_layers)]
        return KVCache.wrap(keys, values)

    def forward(self, input_ids: np.ndarray, seqlens_k: np.ndarray, query_seqlens: np.ndarray,
                logits_indices: np.ndarray, cache: KVCache, capture: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Run one step. input_ids [B, S]; seqlens_k, query_seqlens [B]; logits_indices [B, n] -> logits [B, n, V].

        Row b holds query_seqlens[b] new tokens (right-padded to S) on top of
        seqlens_k[b] + 1 - query_seqlens[b] cached ones. `capture` maps extra graph outputs (a calibration
        graph's) to preallocated arrays that receive them.
        """
        seq = input_ids.shape[1]
        total = max(int(seqlens_k.max()) + 1, seq)
        binding = self.session.io_binding()
        feeds = {
            wire.INPUT_IDS: np.ascontiguousarray(input_ids, np.int64),
            wire.SEQLENS_K: np.ascontiguousarray(seqlens_k, np.int32),
            wire.TOTAL_SEQUENCE_LENGTH: np.array(total, np.int32),
            wire.QUERY_SEQLENS: np.ascontiguousarray(query_seqlens, np.int32),
            wire.LOGITS_INDICES: np.ascontiguousarray(logits_indices, np.int64),
        }
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        for i in range(self.num_layers):
            binding.bind_ortvalue_input(wire.past_key(i), cache.keys_ort[i])
            binding.bind_ortvalue_input(wire.past_value(i), cache.values_ort[i])
            binding.bind_ortvalue_output(wire.present_key(i), cache.keys_ort[i])
            binding.bind_ortvalue_output(wire.present_value(i), cache.values_ort[i])
        logits = np.empty((input_ids.shape[0], logits_indices.shape[1], self.vocab_size), np.float32)
        binding.bind_ortvalue_output(wire.LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        for name, array in (capture or {}).items():
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
        self.session.run_with_iobinding(binding)
        return logits
