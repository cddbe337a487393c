"""The two ONNX Runtime paths for INT8 projections, timed on SmolLM2's shapes: which one should INT8 use?
And, for batched decode, how INT4's MatMulNBits grows with rows at each accuracy level.

- MatMulNBits, 8 bits, blocks of 32, accuracy_level 4: activations quantized to int8 per block of 32 inside
  the kernel (what edge-quantize writes);
- MatMulNBits, 4 bits, blocks of 64 (INT4's), accuracy_level 4 and 0 (fp32 activations): whether the fp32
  kernel, slower for one row, stays flatter as a batch's rows grow;
- MatMulInteger u8 x s8 with a per-row (per-token) activation scale computed in the graph (Abs, ReduceMax,
  Div, Round, Cast around it) and a per-output-channel weight scale. Per-tensor DynamicQuantizeLinear is
  faster still but shares one scale across every token of a call, which the quality measurements ruled out.

30 layers of qkv (960x576), o (576x576), gate_up (3072x576) and down (576x1536), M rows, 2 threads, threads
sleeping between kernels (spin_wait=false: the same for every path). Random weights: only the time matters here.

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
ROWS = (1, 2, 4, 8)


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


def matmul_nbits(weights: list[np.ndarray], threads: int, bits: int = 8, block_size: int = 32,
                 accuracy_level: int = 4) -> ort.InferenceSession:
    nodes, inits, outs = [], [], []
    for i, w in enumerate(weights):
        q = nbits.quantize_rtn(w, bits, block_size, symmetric=True)
        n, k = w.shape
        inits += [nh.from_array(q.packed, f"W{i}"), nh.from_array(q.scales.astype(np.float32), f"S{i}")]
        nodes.append(helper.make_node("MatMulNBits", [input_of(k), f"W{i}", f"S{i}"], [f"Y{i}"], domain="com.microsoft",
                                      K=k, N=n, bits=bits, block_size=block_size, accuracy_level=accuracy_level))
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
             "MatMulInteger u8s8, per-row scale": matmul_integer_per_row(weights, a.threads),
             "MatMulNBits 4-bit, b64, accuracy 4 (INT4's)": matmul_nbits(weights, a.threads, 4, 64, 4),
             "MatMulNBits 4-bit, b64, fp32 activations (accuracy 0)": matmul_nbits(weights, a.threads, 4, 64, 0)}
    x, x2 = rng.standard_normal((max(ROWS), HIDDEN)).astype(np.float32), rng.standard_normal((max(ROWS), INTER)).astype(np.float32)
    ms: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.reps):  # interleaved, so that the shared machine's load falls on both paths alike
        for name, sess in paths.items():
            for m in ROWS:
                ms.setdefault((name, m), []).append(step_ms(sess, {"X": x[:m], "X2": x2[:m]}))
    print(f"| path | {' | '.join(f'{m} row(s) ms' for m in ROWS)} |\n|---|{'--:|' * len(ROWS)}")
    for name in paths:
        print(f"| {name} | {' | '.join(f'{statistics.median(ms[name, m]):.2f}' for m in ROWS)} |")
    first, second, int4, int4_fp32 = list(paths)
    ratios = lambda a, b: ", ".join(f"{m} row(s) {statistics.median(ms[a, m]) / statistics.median(ms[b, m]):.2f}"  # noqa: E731
                                    for m in ROWS)
    print(f"ratio MatMulInteger / MatMulNBits 8-bit: {ratios(second, first)}")
    print(f"ratio INT4 accuracy 0 / accuracy 4: {ratios(int4_fp32, int4)}")
    print("INT4 accuracy 4, m rows / 1 row: "
          + ", ".join(f"{m} {statistics.median(ms[int4, m]) / statistics.median(ms[int4, 1]):.2f}" for m in ROWS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
