"""Activation statistics for importance-weighted quantization (llama.cpp's imatrix, AWQ's saliency).

Runs a calibration text through the fp32 graph with every projection's input exposed as an output and
accumulates, per input channel, the mean squared activation. Channels that carry large activations
contribute more to the output error, so the block search weights their rounding error more.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from agent import wire
from agent.runner import ModelRunner
from quantize.checkpoint import Checkpoint
from quantize.evaluate import windows
from quantize.graph import Importance, build_graph, capture_width
from quantize.precision import QuantSpec

CHUNK_TOKENS = 256


def _accumulate(runner: ModelRunner, ids: list[int], keys: list[str], g, sums: dict, hessians: dict) -> None:
    """Add one context window's activation statistics (chunked like a prefill) into sums / hessians."""
    cache = runner.new_cache(1, len(ids))
    for start in range(0, len(ids), CHUNK_TOKENS):
        part = ids[start:start + CHUNK_TOKENS]
        n = len(part)
        capture = {k: np.empty((1, n, capture_width(g, k)), np.float32) for k in keys}
        runner.forward(np.array([part]), np.array([start + n - 1]), np.array([n]), np.array([[n - 1]]), cache, capture)
        for k, a in capture.items():
            sums[k] += np.square(a[0], dtype=np.float64).sum(0)
            if k in hessians:
                hessians[k] += (a[0].T @ a[0]).astype(np.float64)


@dataclass
class Calibration:
    importance: Importance  # mean squared activation per input channel, by HF weight name
    hessians: dict[str, np.ndarray]  # sum of x x^T [K, K] float64 per projection input (GPTQ), may be empty


def calibrate(ckpt: Checkpoint, ids: list[int], with_hessians: bool = False, threads: int | None = None,
              work_dir: Path | None = None) -> Calibration:
    """Activation statistics of every projection's input over the token ids, keyed by HF weight name.
    work_dir: where the fp32 capture graph is written meanwhile (a whole fp32 model; default $TMPDIR)."""
    g = ckpt.geometry
    model, _ = build_graph(ckpt, QuantSpec(), capture=True)
    keys = [o.name for o in model.graph.output if o.name.startswith("model.")]
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        path = Path(tmp) / wire.GRAPH
        onnx.save_model(model, str(path), save_as_external_data=True, location=wire.GRAPH_DATA)
        del model
        runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads)
        sums = {k: np.zeros(capture_width(g, k), np.float64) for k in keys}
        hessians = {k: np.zeros((capture_width(g, k),) * 2, np.float64) for k in keys} if with_hessians else {}
        positions = 0
        for window in windows(ids, g.context_length, ckpt.tokenizer.prompt_bos):
            _accumulate(runner, window, keys, g, sums, hessians)
            positions += len(window)
    return Calibration({k: (v / positions).astype(np.float32) for k, v in sums.items()}, hessians)
