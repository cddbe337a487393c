"""The two ONNX Runtime paths for INT8 projections, timed on SmolLM2's shapes: which one should INT8 use?

- MatMulNBits, 8 bits, blocks of 32, accuracy_level 4: activations quantized to int8 per block of 32 inside
  the kernel (what edge-quantize writes);
- MatMulInteger u8 x s8 with a per-row (per-token) activation scale computed in the graph (Abs, ReduceMax,
  Div, Round, Cast around it) and a per-output-channel weight scale. Per-tensor DynamicQuantizeLinear is
  faster still but shares one scale across every token of a call, which the quality measurements ruled out.

30 layers of qkv (960x576), o (576x576), gate_up (3072x576) and down (576x1536), M rows, 2 threads, threads
sleeping between kernels as the agent's default. Random weights: only the time matters here.

Run: .venv/bin/python bench/int8_paths.py [--threads 2] [--reps 5]   # ~1 min
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from onnx import numpy_helper as nh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's packages
from quantize import nbits  # noqa: E402

HIDDEN, INTER = 576, 1536
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * 30
ROWS = (1, 4, 8)


def session(nodes, inits, outs, threads: int) -> ort.InferenceSession:
    ins = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", HIDDEN]),
           helper.make_tensor_value_info("X2", TensorProto.FLOAT, ["M", INTER])]
    graph = helper.make_graph(nodes, "projections", ins,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def input_of(k: int) -> str:
    return "X" if k == HIDDEN else "X2"


def matmul_nbits(weights: list[np.ndarray], threads: int) -> ort.InferenceSession:
    nodes, inits, outs = [], [], []
    for i, w in enumerate(weights):
        q = nbits.quantize_rtn(w, 8, 32, symmetric=True)
        n, k = w.shape
        inits += [nh.from_array(q.packed, f"W{i}"), nh.from_array(q.scales.astype(np.float32), f"S{i}")]
        nodes.append(helper.make_node("MatMulNBits", [input_of(k), f"W{i}", f"S{i}"], [f"Y{i}"], domain="com.microsoft",
                                      K=k, N=n, bits=8, block_size=32, accuracy_level=4))
        outs.append(f"Y{i}")
    return session(nodes, inits, outs, threads)


def matmul_integer_per_row(weights: list[np.ndarray], threads: int) -> ort.InferenceSession:
    consts = {"c127": np.array(127, np.float32), "c128": np.array(128, np.float32), "zp": np.array(128, np.uint8)}
    inits = [nh.from_array(v, k) for k, v in consts.items()]
    nodes, outs = [], []
    for x in ("X", "X2"):  # each input quantized once per row, symmetric around the u8 zero point 128
        nodes += [helper.make_node("Abs", [x], [f"{x}_abs"]),
                  helper.make_node("ReduceMax", [f"{x}_abs"], [f"{x}_max"], axes=[1], keepdims=1),
                  helper.make_node("Div", [f"{x}_max", "c127"], [f"{x}_scale"]),
                  helper.make_node("Div", [x, f"{x}_scale"], [f"{x}_n"]),
                  helper.make_node("Round", [f"{x}_n"], [f"{x}_r"]),
                  helper.make_node("Add", [f"{x}_r", "c128"], [f"{x}_o"]),
                  helper.make_node("Cast", [f"{x}_o"], [f"{x}_q"], to=TensorProto.UINT8)]
    for i, w in enumerate(weights):
        x = input_of(w.shape[1])
        scale = np.abs(w).max(1) / 127
        wq = np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int8).T.copy()  # [K, N]
        inits += [nh.from_array(wq, f"W{i}"), nh.from_array(scale.astype(np.float32), f"S{i}")]
        nodes += [helper.make_node("MatMulInteger", [f"{x}_q", f"W{i}", "zp"], [f"A{i}"]),
                  helper.make_node("Cast", [f"A{i}"], [f"F{i}"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", [f"F{i}", f"{x}_scale"], [f"G{i}"]),
                  helper.make_node("Mul", [f"G{i}", f"S{i}"], [f"Y{i}"])]
        outs.append(f"Y{i}")
    return session(nodes, inits, outs, threads)


def step_ms(sess: ort.InferenceSession, feed: dict, calls: int = 20) -> float:
    for _ in range(3):
        sess.run(None, feed)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions; the table shows their median")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s).astype(np.float32) * 0.05 for s in SHAPES]
    paths = {"MatMulNBits 8-bit, b32 (ours)": matmul_nbits(weights, a.threads),
             "MatMulInteger u8s8, per-row scale": matmul_integer_per_row(weights, a.threads)}
    x, x2 = rng.standard_normal((max(ROWS), HIDDEN)).astype(np.float32), rng.standard_normal((max(ROWS), INTER)).astype(np.float32)
    ms: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.reps):  # interleaved, so that the shared machine's load falls on both paths alike
        for name, sess in paths.items():
            for m in ROWS:
                ms.setdefault((name, m), []).append(step_ms(sess, {"X": x[:m], "X2": x2[:m]}))
    print(f"| path | {' | '.join(f'{m} row(s) ms' for m in ROWS)} |\n|---|{'--:|' * len(ROWS)}")
    for name in paths:
        print(f"| {name} | {' | '.join(f'{statistics.median(ms[name, m]):.2f}' for m in ROWS)} |")
    first, second = list(paths)
    print("ratio MatMulInteger / MatMulNBits: "
          + ", ".join(f"{m} row(s) {statistics.median(ms[second, m]) / statistics.median(ms[first, m]):.2f}" for m in ROWS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
