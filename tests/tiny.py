"""Tiny random Llama models written as GGUF files with gguf's GGUFWriter, loaded through the real code.

The tokenizer is a small byte-level BPE (GPT-2 byte alphabet, a few merges, ChatML special tokens), so
the same tokenizer and chat-template code paths run as for the real model. Q and K are written with
llama.cpp's rotary row permutation, exactly as its converter does, so the reader's un-permutation is
exercised. Tensors use several GGML types (F32, F16, Q8_0, Q4_0, Q4_1, Q6_K when the shape allows).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, TokenType
from gguf.quants import quantize

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "o n", "Ġ a", "r e", "e n"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the 256 printable stand-ins for raw bytes, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    return tokens, types


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF half-split rows -> interleaved rotary pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Byte offsets of the float16 scale fields in each K-quant block (llama.cpp's block_q4_K/q5_K/q6_K).
_KQUANT_F16_FIELDS = {QT.Q2_K: (80, 82), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def random_kquant_rows(shape: tuple[int, int], qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant blocks (gguf cannot quantize K-quants): random codes, small fp16 scales."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, type_size), dtype=np.uint8)
    for off in _KQUANT_F16_FIELDS[qtype]:
        raw[..., off:off + 2] = np.full(raw.shape[:2], 0.002, np.float16)[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


def _add(writer: GGUFWriter, name: str, w: np.ndarray, qtype: QT) -> None:
    if qtype in _KQUANT_F16_FIELDS:
        writer.add_tensor(name, random_kquant_rows(w.shape, qtype, np.random.default_rng(w.size)), raw_dtype=qtype)
    elif qtype == QT.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == QT.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype == QT.BF16:
        writer.add_tensor(name, quantize(w.astype(np.float32), qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, quantize(w.astype(np.float32), qtype), raw_dtype=qtype)


def write_tiny_llama(path: Path, *, seed: int = 0, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                     intermediate: int = 128, layers: int = 2, context: int = 256, tied: bool = True,
                     types: tuple[QT, ...] = (QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q4_1),
                     architecture: str = "llama", extra=None, weight_scale: float = 0.08) -> Path:
    """Write a random Llama GGUF to path; weight tensors cycle through `types`. extra(writer): more metadata
    and tensors, written before the file is closed. At the default weight_scale the model's greedy text
    repeats one token whatever the prompt; 0.25 with an untied head makes it depend on the context."""
    rng = np.random.default_rng(seed)
    tokens, token_types = vocab()
    head_dim = hidden // heads
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def rand(*shape: int, scale: float = weight_scale) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    cycle = iter(types * 100)
    _add(writer, "token_embd.weight", rand(len(tokens), hidden, scale=0.5), QT.Q8_0 if QT.Q8_0 in types else QT.F32)
    for i in range(layers):
        p = f"blk.{i}."
        _add(writer, p + "attn_norm.weight", 1 + rand(hidden, scale=0.1), QT.F32)
        _add(writer, p + "ffn_norm.weight", 1 + rand(hidden, scale=0.1), QT.F32)
        _add(writer, p + "attn_q.weight", permute_rows(rand(heads * head_dim, hidden), heads), next(cycle))
        _add(writer, p + "attn_k.weight", permute_rows(rand(kv_heads * head_dim, hidden), kv_heads), next(cycle))
        _add(writer, p + "attn_v.weight", rand(kv_heads * head_dim, hidden), next(cycle))
        _add(writer, p + "attn_output.weight", rand(hidden, heads * head_dim), next(cycle))
        _add(writer, p + "ffn_gate.weight", rand(intermediate, hidden), next(cycle))
        _add(writer, p + "ffn_up.weight", rand(intermediate, hidden), next(cycle))
        _add(writer, p + "ffn_down.weight", rand(hidden, intermediate), next(cycle))
    _add(writer, "output_norm.weight", 1 + rand(hidden, scale=0.1), QT.F32)
    if not tied:
        _add(writer, "output.weight", rand(len(tokens), hidden, scale=0.3), QT.F16)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
