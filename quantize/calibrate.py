"""Activation statistics for importance-weighted quantization (llama.cpp's imatrix, AWQ's saliency) and GPTQ.

Runs a calibration text through the fp32 graph with every projection's input exposed as an output and
accumulates, per input channel, the mean squared activation. Channels that carry large activations
contribute more to the output error, so the block search weights their rounding error more. For GPTQ it
also accumulates each input's Hessian (sum of x x^T), a group at a time (`Hessians`); a Mixture of Experts
layer's input is routed to its experts first (quantize.expert_hessians).
"""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnx

from agent import wire
from agent.process import trim_heap
from agent.engine.runner import ModelRunner
from agent.wire import Geometry
from quantize.checkpoint import Checkpoint
from quantize.evaluate import windows
from quantize.expert_hessians import ExpertHessians, experts_layer
from quantize.graph import LM_HEAD, Importance, build_graph, capture_width
from quantize.precision import QuantSpec

CHUNK_TOKENS = 256
HESSIAN_BUDGET_MB = 2048  # the default of edge-quantize build --hessian-memory-mb


def _accumulate(runner: ModelRunner, ids: list[int], g: Geometry, sums: dict, hessians: dict) -> None:
    """Add one context window's activation statistics (chunked like a prefill) into sums / hessians."""
    cache = runner.new_cache(1, len(ids))
    for start in range(0, len(ids), CHUNK_TOKENS):
        part = ids[start:start + CHUNK_TOKENS]
        n = len(part)
        capture = {k: np.empty((1, n, capture_width(g, k)), np.float32) for k in sums.keys() | hessians.keys()}
        runner.forward(np.array([part]), np.array([start + n - 1]), np.array([n]), np.array([[n - 1]]), cache, capture)
        for k, a in capture.items():
            if k in sums:
                sums[k] += np.square(a[0], dtype=np.float64).sum(0)
            if k in hessians:
                if isinstance(hessians[k], ExpertHessians):
                    hessians[k].add(a[0])
                else:
                    hessians[k] += (a[0].T @ a[0]).astype(np.float64)


def hessian_bytes(g: Geometry, key: str) -> int:
    if experts_layer(key) is not None:
        return ExpertHessians.nbytes_for(g)
    return capture_width(g, key) ** 2 * np.dtype(np.float64).itemsize


def _zeros(ckpt: Checkpoint, key: str) -> np.ndarray | ExpertHessians:
    """The empty Hessian of key: [K, K], or a MoE layer's per-expert ones (quantize.expert_hessians)."""
    i = experts_layer(key)
    if i is not None:
        return ExpertHessians.zeros(ckpt, i)
    return np.zeros((capture_width(ckpt.geometry, key),) * 2, np.float64)


class Hessians:
    """GPTQ's Hessians, sum of x x^T over the calibration tokens ([K, K] float64 per projection input), held a
    group at a time and handed out in the order the graph builder asks for them (`pop`, as a dict's).

    All at once they outweigh the rest of a build: 512 MiB for one down_proj input of a 1B Llama, ~10 GB
    for its 16 layers (held together, a 1B model needs well over 8 GB to quantize). So only as many as
    fit in budget_bytes are held (at least one), and when the builder asks for one past them the
    calibration text runs through the fp32 graph again for the next group, in a session opened for that
    pass alone (the whole model in fp32: not held while GPTQ works). Each Hessian sums the same chunks in
    the same order in any group, so the bundle is the same bit for bit whatever the budget; a smaller
    budget costs a pass over the text per group.
    """

    def __init__(self, open_runner: Callable[[], ModelRunner], texts: list[list[int]], ckpt: Checkpoint,
                 keys: list[str], budget_bytes: int):
        self.open_runner, self.texts, self.ckpt, self.keys = open_runner, texts, ckpt, keys
        self.g = ckpt.geometry
        self.budget_bytes = budget_bytes
        self.ready: dict[str, np.ndarray] = {}
        self.next = 0  # keys[:next] have been computed (and handed out, or dropped once passed)
        self.passes = 0
        self.most_held_bytes = 0

    def next_group(self) -> dict[str, np.ndarray]:
        """Zeroed Hessians for the next keys that fit in the budget together (at least one)."""
        group: dict[str, np.ndarray] = {}
        held = 0
        for key in self.keys[self.next:]:
            size = hessian_bytes(self.g, key)
            if group and held + size > self.budget_bytes:
                break
            group[key] = _zeros(self.ckpt, key)
            held += size
        self.next += len(group)
        return group

    def add(self, group: dict[str, np.ndarray]) -> None:
        """Take a group computed in a pass over the texts."""
        self.ready.update(group)
        self.passes += 1
        self.most_held_bytes = max(self.most_held_bytes, sum(h.nbytes for h in self.ready.values()))

    def pop(self, key: str, default: np.ndarray | None = None) -> np.ndarray | ExpertHessians | None:
        if key not in self.ready and key in self.keys[self.next:]:
            # those before it were passed over (a projection kept in fp32 or from the source's blocks)
            self.ready.clear()
            self.next = self.keys.index(key)
            group = self.next_group()
            runner = self.open_runner()
            for text in self.texts:
                _accumulate(runner, text, self.g, {}, group)
            del runner
            trim_heap()  # the session's heap, before GPTQ takes its own
            self.add(group)
        return self.ready.pop(key, default)

    def close(self) -> None:
        self.next = len(self.keys)
        self.ready.clear()


@dataclass
class Calibration:
    importance: Importance  # mean squared activation per input channel, by HF weight name
    hessians: Hessians  # per projection input, for GPTQ (none without)


@contextmanager
def calibration(ckpt: Checkpoint, ids: list[int], with_hessians: bool = False, threads: int | None = None,
                work_dir: Path | None = None, hessian_budget_mb: float = HESSIAN_BUDGET_MB) -> Iterator[Calibration]:
    """Activation statistics of every projection's input over the token ids, keyed by HF weight name, valid
    inside the with block (its Hessians may still need the fp32 graph there).
    work_dir: where the fp32 capture graph is written meanwhile (a whole fp32 model; default $TMPDIR)."""
    g = ckpt.geometry
    model, _ = build_graph(ckpt, QuantSpec(), capture=True)
    keys = [o.name for o in model.graph.output if o.name.startswith("model.") or o.name == LM_HEAD]
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        path = Path(tmp) / wire.GRAPH
        onnx.save_model(model, str(path), save_as_external_data=True, location=wire.GRAPH_DATA)
        del model
        texts = windows(ids, g.context_length, ckpt.tokenizer.prompt_bos)
        open_runner = lambda: ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads)  # noqa: E731
        hessians = Hessians(open_runner, texts, ckpt, keys if with_hessians else [], int(hessian_budget_mb * 2**20))
        sums = {k: np.zeros(capture_width(g, k), np.float64) for k in keys}
        first = hessians.next_group() if with_hessians else {}
        runner = open_runner()
        for text in texts:  # the first group's Hessians in the pass that measures importance
            _accumulate(runner, text, g, sums, first)
        del runner
        trim_heap()
        hessians.add(first)
        positions = sum(len(t) for t in texts)
        try:
            yield Calibration({k: (v / positions).astype(np.float32) for k, v in sums.items()}, hessians)
        finally:
            hessians.close()
