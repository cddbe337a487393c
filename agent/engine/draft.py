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
import time
from collections.abc import Callable

import numpy as np

from agent.engine.bundle import Bundle
from agent.engine.kv_cache import KVPool, SlotPool
from agent.engine.memory import kv_bytes_per_token
from agent.engine.request import RequestError
from agent.engine.runner import ModelRunner, open_runner
from agent.engine.speculative import greedy


def same_tokenizer(a: str, b: str) -> bool:
    """The two tokenizer.json documents hold the same tokenizer: compared as JSON, not as text, since how a
    document is spaced depends on the quantizer that wrote the bundle (quantize.tokenizer writes it compact,
    earlier versions with spaces after separators)."""
    return a == b or json.loads(a) == json.loads(b)


class DraftModel:
    SHORT_RUN = 4  # tokens a drafting call catches up on with its first draft position; more run beforehand
    catch_up_s = 0.0  # seconds the last propose_many spent catching up on longer runs

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
        return self.propose_many({seq_id: (ids, k, choose)})[seq_id]

    def propose_many(self, wants: dict[int, tuple[list[int], int, Callable[[np.ndarray], int]]]) -> dict[int, list[int]]:
        """propose for several sequences (id -> (ids, k, choose)): per size class, one draft-model call per draft
        position for all of them, so a batch's drafts cost about what one sequence's do."""
        self.catch_up_s = 0.0
        by_pool: dict[int, tuple[SlotPool, list[int]]] = {}
        for seq_id in wants:
            pool = self.kv.where[seq_id]
            by_pool.setdefault(id(pool), (pool, []))[1].append(seq_id)
        drafts: dict[int, list[int]] = {}
        for pool, seq_ids in by_pool.values():
            drafts |= self._propose_in(pool, {s: wants[s] for s in seq_ids})
        return drafts

    def _propose_in(self, pool: SlotPool, wants: dict) -> dict[int, list[int]]:
        runs = {seq_id: self._catch_up(pool, seq_id, ids) for seq_id, (ids, _, _) in wants.items()}
        # the batch is padded to its longest run, and every slot needs room for a whole padded row
        room = max(pool.capacity - max(pool.lengths.get(o, 0) for o in pool.owners), 1)
        for seq_id, (done, run) in list(runs.items()):
            if len(run) > room:
                self.runner.forward_slot(pool, pool.slot_of(seq_id), run[:len(run) - room], done, logits=False)
                runs[seq_id] = (done + len(run) - room, run[len(run) - room:])
        rows = {owner: row for row, owner in enumerate(pool.owners)}
        drafts = {seq_id: [] for seq_id in wants}
        held = {seq_id: len(ids) for seq_id, (ids, _, _) in wants.items()}  # ids + drafts but the last: cached
        while runs:
            logits = self.runner.forward_decode(pool, runs)
            for seq_id, (_, run) in runs.items():
                drafts[seq_id].append(wants[seq_id][2](logits[rows[seq_id], len(run) - 1]))
            runs = {seq_id: (held[seq_id], drafts[seq_id][-1:]) for seq_id in runs
                    if len(drafts[seq_id]) < wants[seq_id][1]}
            for seq_id in runs:
                held[seq_id] += 1
        for seq_id, n in held.items():
            self.computed[seq_id] = pool.lengths[seq_id] = n
        return drafts

    def _catch_up(self, pool: SlotPool, seq_id: int, ids: list[int]) -> tuple[int, list[int]]:
        """(tokens cached, the rest of ids to run, at most SHORT_RUN). A longer catch-up (a new prompt, or after a
        preemption) runs here, timed into catch_up_s: it is the draft's prefill, paid once, not a cost of each
        draft token; in the target's prefill chunks, since one call over a 4,000-token prompt took ~20 MB past
        the measured budget, and ONNX Runtime's arena kept it."""
        done = min(self.computed.get(seq_id, 0), len(ids) - 1)
        t0 = time.perf_counter()
        while len(ids) - done > self.SHORT_RUN:
            n = min(self.chunk_tokens, len(ids) - done - self.SHORT_RUN)
            self.runner.forward_slot(pool, pool.slot_of(seq_id), ids[done:done + n], done, logits=False)
            done += n
        self.catch_up_s += time.perf_counter() - t0
        return done, ids[done:]

    def accepted(self, seq_id: int, num_valid: int) -> None:
        """After verification: only the first num_valid tokens of the draft's cache match the sequence."""
        self.computed[seq_id] = min(self.computed.get(seq_id, 0), num_valid)
