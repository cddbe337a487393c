"""Measure what quantization cost: perplexity, KL divergence and top-1 agreement against the fp32 graph.

Both graphs run the text the way the engine runs prompts (chunked prefill through the KV cache, logits
for every position of each chunk), so the figures include whatever the kernels do to activations.

Run: edge-quantize eval BUNDLE --reference FP32_BUNDLE --text FILE [--json]
"""
from __future__ import annotations

import hashlib

import numpy as np

from agent.engine.runner import ModelRunner
from agent.wire import Quality

CHUNK_TOKENS = 256


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def chunked_logits(runner: ModelRunner, ids: list[int], chunk: int = CHUNK_TOKENS):
    """Yield (start, log-probs [n, V]) for consecutive chunks of ids, decoding through one KV cache."""
    cache = runner.new_cache(1, len(ids))
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        n = len(part)
        logits = runner.forward(np.array([part]), np.array([start + n - 1]), np.array([n]), np.arange(n)[None], cache)
        yield start, log_softmax(logits[0])


def windows(ids: list[int], context_length: int, bos: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of at most context_length tokens (a text longer than the context is
    scored window by window, each from an empty cache, as perplexity tools do), each starting with bos
    when the model's prompts do: the engine adds it, and llama.cpp's perplexity adds it to every chunk."""
    if bos is None:
        return [ids[i:i + context_length] for i in range(0, len(ids), context_length)]
    step = context_length - 1
    return [[bos] + ids[i:i + step] for i in range(0, len(ids), step)]


def compare(runner: ModelRunner, reference: ModelRunner, ids: list[int], text: str, context_length: int,
            bos: int | None = None) -> Quality:
    """Quality of `runner` against `reference` over token ids (the text's, for its hash); bos: see windows()."""
    kls, agree, nll, ref_nll, n_pred = [], 0, 0.0, 0.0, 0
    for window in windows(ids, context_length, bos):
        for (start, lp), (_, ref_lp) in zip(chunked_logits(runner, window), chunked_logits(reference, window)):
            kls.append((np.exp(ref_lp) * (ref_lp - lp)).sum(-1))  # KL(reference || quantized), per position
            agree += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
            nxt = np.array(window[start + 1:start + 1 + len(lp)])  # a window's last position has no next token
            rows = np.arange(len(nxt))
            nll -= lp[rows, nxt].sum()
            ref_nll -= ref_lp[rows, nxt].sum()
            n_pred += len(nxt)
    kl = np.concatenate(kls)
    return Quality(
        tokens=len(ids),
        perplexity=float(np.exp(nll / n_pred)),
        reference_perplexity=float(np.exp(ref_nll / n_pred)),
        mean_kl=float(kl.mean()),
        p99_kl=float(np.percentile(kl, 99)),
        top1_agreement=agree / len(kl),  # over every position scored (a BOS's too)
        text_sha256=hashlib.sha256(text.encode()).hexdigest(),
    )


def greedy(runner: ModelRunner, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens after the prompt: one prefill, then one token per step through the cache."""
    cache = runner.new_cache(1, len(prompt_ids) + n)
    p = len(prompt_ids)
    logits = runner.forward(np.array([prompt_ids]), np.array([p - 1]), np.array([p]), np.array([[p - 1]]), cache)
    out = [int(logits[0, -1].argmax())]
    for t in range(p, p + n - 1):
        logits = runner.forward(np.array([[out[-1]]]), np.array([t]), np.array([1]), np.zeros((1, 1), np.int64), cache)
        out.append(int(logits[0, -1].argmax()))
    return out
