"""Record what llama.cpp computes for the real models, for tests/quantize/test_real_archs.py.

For each model: the first N token ids of quantize/data/eval_en.txt as llama.cpp tokenizes them (its BOS
rule), and llama.cpp's top-K log-probabilities at every position, twice: on the GGUF file as it is, and on
an F32 copy of it (every tensor dequantized, names and metadata unchanged). The second is llama.cpp on
exactly the weights our fp32 graph computes with, without the 8-bit activations its quantized kernels
use: the tight check that we compute each architecture as llama.cpp does.

Needs the peer venv (bench/setup_peers). Run from the repository root with the product venv:
    .venv/bin/python tests/quantize/record_real_logits.py            # a few minutes on 2 cores
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from quantize.fetch import fetch  # noqa: E402

OUT = Path(__file__).parent / "data" / "llamacpp_real_logits"
PEER_PYTHON = REPO / ".venv-peers" / "bin" / "python"
TOP_K = 32
# tokens per model: Gemma's run crosses its 512-token sliding window
MODELS = {"qwen2.5-coder-0.5b-instruct": 512, "gemma3-270m": 768}

PEER = r"""
import json, sys
import llama_cpp, numpy as np
model, text_path, n, k, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)
ids = vocab.tokenize(open(text_path, "rb").read(), add_bos=vocab.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true")[:n]
llm = llama_cpp.Llama(model, n_ctx=1024, n_batch=256, n_ubatch=256, logits_all=True, n_threads=2, verbose=False)
llm.eval(ids)
x = np.asarray(llm.scores[:len(ids)], np.float64)
lp = x - x.max(-1, keepdims=True)
lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
top = np.argsort(-lp, axis=-1)[:, :k]
np.savez(out, ids=np.array(ids, np.int32), top_ids=top.astype(np.int32),
         top_logprobs=np.take_along_axis(lp, top, -1).astype(np.float32))
print(json.dumps({"llama_cpp": llama_cpp.__version__}))
"""


def f32_copy(src: Path, dst: Path) -> Path:
    """src with every tensor dequantized to F32, names and metadata unchanged."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        writer.add_key_value(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape))
        writer.add_tensor(t.name, dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def record(name: str, n: int, work: Path) -> None:
    source = fetch(name)
    text = REPO / "quantize" / "data" / "eval_en.txt"
    for kind, model in (("file", source), ("f32", f32_copy(source, work / f"{name}.f32.gguf"))):
        out = OUT / f"{name}.{kind}.npz"
        p = subprocess.run([str(PEER_PYTHON), "-c", PEER, str(model), str(text), str(n), str(TOP_K), str(out)],
                           check=True, capture_output=True, text=True)
        info = json.loads(p.stdout.strip().splitlines()[-1])
        (OUT / f"{name}.{kind}.json").write_text(json.dumps(info | {"source_sha256": _sha256(source),
                                                                    "tokens": n, "top_k": TOP_K}, indent=1) + "\n")
        print(name, kind, info, flush=True)
        if kind == "f32":
            model.unlink()


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model_name, tokens in MODELS.items():
            record(model_name, tokens, Path(tmp))
