"""Prefix caching: KV of prompt blocks already computed, kept for the next prompt that starts the same way.

Blocks are `block_tokens` tokens, identified by a hash chain (a block's key is its parent's key and its
own tokens, as in vLLM and nano-vllm), so a block matches only at the same position after the same
prefix. The store is its own preallocated buffer per layer, [blocks, kv_heads, block_tokens, head_dim],
counted in the memory budget. A hit copies the blocks into the new sequence's slot (a memcpy, a few MB,
instead of a prefill); a finished prefill copies its prompt's new full blocks in. Blocks are evicted
least recently used. Because blocks are copied, never shared, a running sequence never pins one.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from agent.kv_cache import SlotPool
from agent.runner import lazy_zeros


class PrefixCache:
    def __init__(self, num_blocks: int, block_tokens: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: np.dtype = np.dtype(np.float32)):
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        shape = (num_blocks, kv_heads, block_tokens, head_dim)
        self.keys = [lazy_zeros(shape, dtype) for _ in range(num_layers)]
        self.values = [lazy_zeros(shape, dtype) for _ in range(num_layers)]
        # chain key -> (block index, the block's tokens); most recently used last
        self.index: OrderedDict[tuple, tuple[int, tuple[int, ...]]] = OrderedDict()
        self.free = list(range(num_blocks - 1, -1, -1))
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def _chain(self, ids: list[int], n_blocks: int):
        """(chain key, tokens) of each of the first n_blocks full blocks of ids."""
        key: tuple = ()
        for b in range(n_blocks):
            tokens = tuple(ids[b * self.block_tokens:(b + 1) * self.block_tokens])
            key = (hash(key), tokens)
            yield key, tokens

    def load(self, prompt_ids: list[int], pool: SlotPool, slot: int) -> int:
        """Copy the longest cached prefix of prompt_ids into the slot; returns the tokens it covers.

        At least one prompt token is always left to compute: its logits give the first output token.
        """
        usable = (len(prompt_ids) - 1) // self.block_tokens
        self.queried_tokens += len(prompt_ids)
        n = 0
        for key, tokens in self._chain(prompt_ids, usable):
            hit = self.index.get(key)
            if hit is None or hit[1] != tokens:
                break
            self.index.move_to_end(key)
            self._copy_block(hit[0], pool, slot, n, into_slot=True)
            n += self.block_tokens
        self.hit_tokens += n
        return n

    def store(self, prompt_ids: list[int], pool: SlotPool, slot: int) -> None:
        """Copy the prompt's full blocks that are not cached yet out of the slot (after its prefill)."""
        n_blocks = len(prompt_ids) // self.block_tokens
        for b, (key, tokens) in enumerate(self._chain(prompt_ids, n_blocks)):
            if key in self.index:
                self.index.move_to_end(key)
                continue
            block = self._take_block()
            if block is None:
                return
            self._copy_block(block, pool, slot, b * self.block_tokens, into_slot=False)
            self.index[key] = (block, tokens)

    def _take_block(self) -> int | None:
        if self.free:
            return self.free.pop()
        if not self.index:
            return None
        _, (block, _) = self.index.popitem(last=False)  # least recently used
        return block

    def _copy_block(self, block: int, pool: SlotPool, slot: int, start: int, into_slot: bool) -> None:
        end = start + self.block_tokens
        for store, buf in zip(self.keys + self.values, pool.keys + pool.values):
            # store[block]: [kv_heads, block_tokens, head_dim]; buf[slot, :, start:end]: the same shape
            if into_slot:
                buf[slot, :, start:end] = store[block]
            else:
                store[block] = buf[slot, :, start:end]
