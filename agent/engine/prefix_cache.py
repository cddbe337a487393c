"""Prefix caching: KV of prompt blocks already computed, kept for the next prompt that starts the same way.

Blocks are `block_tokens` tokens, identified by a hash chain (a block's key is its parent's key and its
own tokens, as in vLLM and nano-vllm), so a block matches only at the same position after the same
prefix. A block lives in one of two places:
- in the slot of the running sequence that computed it: indexed when its prefill ends, not copied, since a
  sequence only appends and its prompt positions stay valid while it runs;
- in the store, its own preallocated buffer per layer, [blocks, kv_heads, block_tokens, head_dim], counted
  in the memory budget: when that sequence leaves, its blocks move there (copied, then the slot's pages go
  back to the OS layer by layer, so a prompt is never held twice).
A hit copies the blocks into the new sequence's slot (a memcpy, a few MB, instead of a prefill). Store
blocks are evicted least recently used, and a chain is always touched from its last block to its first, so
within a chain the tail goes first: a block matches only after all its parents, so evicting a chain's head
would leave the rest unreachable yet holding the store (chats taking turns would evict each other's heads
and never hit), as vLLM frees a sequence's blocks in reverse. Because blocks are copied, never shared, a
running sequence never pins one.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from agent.engine.kv_cache import KVPool, SlotPool
from agent.process import lazy_zeros, release_pages

Live = tuple[int, int]  # (sequence id, first token position) of a block still in that sequence's slot


class PrefixCache:
    def __init__(self, num_blocks: int, block_tokens: int, kv: KVPool, num_layers: int, kv_heads: int,
                 head_dim: int, dtype: np.dtype = np.dtype(np.float32)):
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self.kv = kv
        shape = (num_blocks, kv_heads, block_tokens, head_dim)
        self.keys = [lazy_zeros(shape, dtype) for _ in range(num_layers)]
        self.values = [lazy_zeros(shape, dtype) for _ in range(num_layers)]
        # chain key -> (store block index or Live, the block's tokens); most recently used last
        self.index: OrderedDict[bytes, tuple[int | Live, tuple[int, ...]]] = OrderedDict()
        self.chains: dict[int, list[bytes]] = {}  # sequence id -> chain keys of all its prompt's full blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def _chain(self, ids: list[int], n_blocks: int, salt: bytes = b""):
        """(chain key, tokens) of each of the first n_blocks full blocks of ids. The key is a SHA-256 of the
        parent's key and the block's tokens: Python's 64-bit hash() of ints is not seeded, so one local client
        could craft a prompt whose prefix collides with another's and be served that KV (vLLM's advisory
        GHSA-rm76-4mrf-v9r8; SHA-256 is its default since v0.10.2). ~1 us a block. salt seeds the chain: a LoRA
        adapter's (Adapter.prefix_salt) changes every block's KV, so its blocks match only its own prompts."""
        key = salt
        for b in range(n_blocks):
            tokens = tuple(ids[b * self.block_tokens:(b + 1) * self.block_tokens])
            key = hashlib.sha256(key + np.asarray(tokens, np.int64).tobytes()).digest()
            yield key, tokens

    def load(self, prompt_ids: list[int], pool: SlotPool, slot: int, count: bool = True, salt: bytes = b"") -> int:
        """Copy the longest cached prefix of prompt_ids into the slot; returns the tokens it covers.

        At least two prompt tokens are always left to compute: the last one's logits give the first output
        token, and computed alone (scheduler.has_lone_row) they would round differently from a cold run's.
        count=False keeps the lookup out of the hit ratio (a preempted request reloading its own blocks).
        """
        usable = max(0, len(prompt_ids) - 2) // self.block_tokens
        self.queried_tokens += len(prompt_ids) if count else 0
        n, matched = 0, []
        for key, tokens in self._chain(prompt_ids, usable, salt):
            hit = self.index.get(key)
            if hit is None or hit[1] != tokens:
                break
            matched.append(key)
            self._copy_in(hit[0], pool, slot, n)
            n += self.block_tokens
        self._touch(matched)
        self.hit_tokens += n if count else 0
        return n

    def _touch(self, chain: list[bytes]) -> None:
        """Make a chain's blocks the most recently used, its head most of all (evicted last)."""
        for key in reversed(chain):
            self.index.move_to_end(key)

    def _copy_in(self, where: int | Live, pool: SlotPool, slot: int, start: int) -> None:
        end = start + self.block_tokens
        if isinstance(where, int):
            sources = [store[where] for store in self.keys + self.values]
        else:
            seq_id, src_start = where
            src_pool = self.kv.where[seq_id]
            src_slot = src_pool.slot_of(seq_id)
            sources = [buf[src_slot, :, src_start:src_start + self.block_tokens]
                       for buf in src_pool.keys + src_pool.values]
        for src, buf in zip(sources, pool.keys + pool.values):
            buf[slot, :, start:end] = src  # [kv_heads, block_tokens, head_dim]

    def store(self, seq_id: int, prompt_ids: list[int], salt: bytes = b"") -> None:
        """Index the prompt's full blocks that are not cached yet where they are: in seq_id's slot."""
        n_blocks = len(prompt_ids) // self.block_tokens
        self.chains[seq_id] = []
        for b, (key, tokens) in enumerate(self._chain(prompt_ids, n_blocks, salt)):
            self.chains[seq_id].append(key)
            if key not in self.index:
                self.index[key] = ((seq_id, b * self.block_tokens), tokens)
        self._touch(self.chains[seq_id])

    def retire(self, seq_id: int, pool: SlotPool) -> None:
        """Before seq_id's slot is freed: move the blocks living in it to the store (as many as fit).

        The prompt was in use until now, so its whole chain becomes the most recently used. A block is placed
        only while all its parents are cached: a room for it may evict a later block of its own chain (tail
        first), never an earlier one. Where the chain is cut (a parent evicted while this sequence ran, or no
        room), nothing after the cut can match any prompt again, so its blocks are let go, stored ones too:
        kept, they would hold the store and evict other chats' reachable blocks.
        """
        chain = self.chains.pop(seq_id, [])
        self._touch([k for k in chain if k in self.index])
        moves, cut = [], len(chain)  # moves: (key, first token position in the slot, store block)
        for i, key in enumerate(chain):
            where = self.index.get(key, (None,))[0]
            if where is None:
                cut = i
                break
            if isinstance(where, int) or where[0] != seq_id:  # stored already, or in another running slot
                continue
            block = self._take_block(set(chain[:i]))
            if block is None:
                cut = i
                break
            moves.append((key, where[1], block))
        for key in chain[cut:]:
            where = self.index.get(key, (None,))[0]
            if isinstance(where, int):
                del self.index[key]
                self.free.append(where)
            elif where is not None and where[0] == seq_id:
                del self.index[key]  # in the slot about to be freed
        slot = pool.slot_of(seq_id)
        for store, buf in zip(self.keys + self.values, pool.keys + pool.values):
            for _, start, block in moves:
                store[block] = buf[slot, :, start:start + self.block_tokens]
            release_pages(buf[slot])  # this layer's copy is done: never hold the prompt twice
        for key, _, block in moves:
            self.index[key] = (block, self.index[key][1])

    def _take_block(self, protect: set[bytes]) -> int | None:
        """A free store block, evicting the least recently used stored (not living, not protected) block."""
        if self.free:
            return self.free.pop()
        victim = next((k for k, (where, _) in self.index.items() if isinstance(where, int) and k not in protect),
                      None)
        if victim is None:
            return None
        block, _ = self.index.pop(victim)
        return block
