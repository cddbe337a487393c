"""The draft model for speculative decoding: a smaller or more heavily quantized bundle with the same
tokenizer, whose guesses (greedy, or drawn from its own distribution for a sampled request) the target
verifies in one pass.

Its KV cache mirrors the target's slots (KVPool.attach_mirror). Per sequence it keeps how many tokens
its cache holds; before drafting it catches up on the tokens the target accepted since (one chunked
call), then decodes k tokens greedily. Positions the target rejects are overwritten next time, exactly as
in the target's cache.
"""
from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from agent.engine.bundle import Bundle
from agent.engine.kv_cache import KVPool
from agent.engine.memory import kv_bytes_per_token
from agent.engine.request import RequestError
from agent.engine.runner import ModelRunner, open_runner


def same_tokenizer(a: str, b: str) -> bool:
    """The two tokenizer.json documents hold the same tokenizer: compared as JSON, not as text, since how a
    document is spaced depends on the quantizer that wrote the bundle (quantize.tokenizer writes it compact,
    earlier versions with spaces after separators)."""
    return a == b or json.loads(a) == json.loads(b)


def greedy(row: np.ndarray) -> int:
    return int(row.argmax())


class DraftModel:
    def __init__(self, bundle: Bundle, target: Bundle, threads: int | None, chunk_tokens: int):
        if not same_tokenizer(bundle.tokenizer_json(), target.tokenizer_json()):
            raise RequestError(f"draft model {bundle.manifest.name}@{bundle.manifest.version} has another tokenizer "
                               f"than {target.manifest.name}; speculative decoding needs the same one")
        self.bundle, self.chunk_tokens = bundle, chunk_tokens
        self.runner: ModelRunner = open_runner(bundle, threads)
        self.kv: KVPool | None = None
        self.computed: dict[int, int] = {}  # sequence id -> tokens in the draft's cache

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.bundle.config
        return kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.runner.kv_dtype.itemsize)

    def attach(self, target_kv: KVPool) -> None:
        c = self.bundle.config
        self.kv = target_kv.attach_mirror(c.num_layers, c.num_kv_heads, c.head_dim, self.runner.kv_dtype)

    def forget(self, seq_id: int) -> None:
        self.computed.pop(seq_id, None)

    def propose(self, seq_id: int, ids: list[int], k: int, choose: Callable[[np.ndarray], int] = greedy) -> list[int]:
        """k tokens after ids (ids = the sequence so far, including its last, not-yet-verified token), each
        chosen from its row of logits by `choose` (greedy by default)."""
        pool = self.kv.where[seq_id]
        slot = pool.slot_of(seq_id)
        done = min(self.computed.get(seq_id, 0), len(ids) - 1)
        # Catching up (a new prompt, or after a preemption) goes in the target's prefill chunks: one call over a
        # 4,000-token prompt took ~20 MB past the measured budget, and ONNX Runtime's arena kept it.
        while len(ids) - done > self.chunk_tokens:
            self.runner.forward_slot(pool, slot, ids[done:done + self.chunk_tokens], done, logits=False)
            done += self.chunk_tokens
        logits = self.runner.forward_slot(pool, slot, ids[done:], done)
        draft = [choose(logits[0, 0])]
        n = len(ids)
        while len(draft) < k:
            logits = self.runner.forward_slot(pool, slot, [draft[-1]], n)
            draft.append(choose(logits[0, 0]))
            n += 1
        self.computed[seq_id] = n  # ids + all drafts but the last are in the cache
        pool.lengths[seq_id] = n
        return draft

    def accepted(self, seq_id: int, num_valid: int) -> None:
        """After verification: only the first num_valid tokens of the draft's cache match the sequence."""
        self.computed[seq_id] = min(self.computed.get(seq_id, 0), num_valid)
