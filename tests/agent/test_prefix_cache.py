"""The prefix cache's bookkeeping, pure: sha256-chained block keys, what retiring stores, eviction order, chains cut
while they ran."""
from __future__ import annotations

import hashlib

import numpy as np

from agent.engine.kv_cache import KVPool
from agent.engine.memory import SizeClass
from agent.engine.prefix_cache import PrefixCache


def test_block_keys_are_sha256_chained_over_the_tokens():
    """Python's hash() is not seeded for ints, so keys chained with it would let a crafted prompt collide with
    another client's prefix and be served its KV. A key is SHA-256 over its parent's and its tokens."""
    kv = KVPool([SizeClass(64, 1)], num_layers=1, kv_heads=1, head_dim=4)
    cache = PrefixCache(4, 16, kv, num_layers=1, kv_heads=1, head_dim=4)
    keys = [key for key, _ in cache._chain(list(range(40)), 2)]
    first = hashlib.sha256(np.arange(16, dtype=np.int64).tobytes()).digest()
    assert keys == [first, hashlib.sha256(first + np.arange(16, 32, dtype=np.int64).tobytes()).digest()]


def serve_through_cache(kv: KVPool, cache: PrefixCache, seq_id: int, prompt: list[int]) -> int:
    """One request as the engine runs it, as far as the prefix cache sees: load its cached prefix, "prefill"
    the rest (position p holds the token at p), index and retire its blocks, free its slot. Returns the hit."""
    pool = kv.allocate(seq_id, 128)
    slot = pool.slot_of(seq_id)
    hit = cache.load(prompt, pool, slot)
    for buf in pool.keys + pool.values:  # "prefill" the rest: position p holds the token at p
        buf[slot, 0, hit:len(prompt)] = np.array(prompt[hit:], np.float32)[:, None]
    cache.store(seq_id, prompt)
    cache.retire(seq_id, pool)
    kv.free(seq_id)
    return hit


def test_retiring_never_evicts_its_own_chain_to_store_its_tail():
    """A full store drops a prompt's last blocks rather than evicting its first ones (which would orphan all)."""
    kv = KVPool([SizeClass(128, 3)], num_layers=1, kv_heads=1, head_dim=4)
    cache = PrefixCache(5, 16, kv, num_layers=1, kv_heads=1, head_dim=4)
    system = list(range(100, 164))  # 4 blocks
    b = system + list(range(200, 232)) + [2]  # 6 blocks and one token

    def run(seq_id: int, prompt: list[int]) -> int:
        return serve_through_cache(kv, cache, seq_id, prompt)

    assert run(1, system + [1]) == 0
    assert run(2, b) == 64  # the 4 system blocks; its 2 own blocks fit 1 free store block: the last is dropped
    pool = kv.allocate(3, 128)
    assert cache.load(b, pool, pool.slot_of(3)) == 80  # the whole stored chain is still reachable
    assert np.array_equal(pool.keys[0][pool.slot_of(3), 0, :80, 0], np.array(b[:80], np.float32))


def test_eviction_takes_a_chains_tail_before_its_head():
    """A chain's blocks are touched tail to head, so the tail of a stored chat is evicted first: evicting its
    head would leave the rest unreachable (a block matches only after its parents) while they held the
    store, and chats taking turns would get no hits at all."""
    kv = KVPool([SizeClass(128, 2)], num_layers=1, kv_heads=1, head_dim=4)
    cache = PrefixCache(8, 4, kv, num_layers=1, kv_heads=1, head_dim=4)

    def run(seq_id: int, prompt: list[int]) -> int:
        return serve_through_cache(kv, cache, seq_id, prompt)

    chat_a, chat_b = list(range(100, 132)), list(range(500, 508))  # 8 blocks (the whole store), 2 blocks
    assert run(1, chat_a) == 0
    assert run(2, chat_b) == 0  # takes 2 store blocks: chat A's last two go
    assert run(3, chat_a + [1, 2, 3]) == 24  # A's first 6 blocks still hit
    pool = kv.allocate(4, 128)
    assert cache.load(chat_a + [9, 9], pool, pool.slot_of(4)) == 32  # and A's next turn stored its own again
    assert np.array_equal(pool.keys[0][pool.slot_of(4), 0, :32, 0], np.array(chat_a, np.float32))


def test_a_chain_cut_while_it_ran_stores_nothing_past_the_cut():
    """A request that hit a stored prefix runs on while other chats evict that prefix; when it retires, its own
    blocks after the gap (which nothing can reach) are not stored, so they evict no reachable block of
    another chat."""
    kv = KVPool([SizeClass(128, 4)], num_layers=1, kv_heads=1, head_dim=4)
    cache = PrefixCache(6, 4, kv, num_layers=1, kv_heads=1, head_dim=4)
    prefix = list(range(100, 108))  # 2 blocks
    assert serve_through_cache(kv, cache, 1, prefix + [1]) == 0
    running = prefix + list(range(300, 308)) + [2]  # hits the prefix, then 2 blocks of its own
    pool = kv.allocate(2, 128)
    slot = pool.slot_of(2)
    assert cache.load(running, pool, slot) == 8
    for buf in pool.keys + pool.values:
        buf[slot, 0, 8:len(running)] = np.array(running[8:], np.float32)[:, None]
    cache.store(2, running)
    chat_b, chat_c = list(range(500, 512)), list(range(600, 612))  # 3 blocks each: the prefix is evicted
    assert serve_through_cache(kv, cache, 3, chat_b + [3]) == 0
    assert serve_through_cache(kv, cache, 4, chat_c + [4]) == 0
    cache.retire(2, pool)
    kv.free(2)
    assert serve_through_cache(kv, cache, 5, chat_b + [5, 5]) == 12  # still whole
    assert serve_through_cache(kv, cache, 6, chat_c + [6, 6]) == 12


def test_retiring_lets_go_of_its_chains_stored_blocks_past_a_cut():
    """A chain's later block already stored (by another request sharing the prefix) is let go when its head
    finds no room: the store keeps no block nothing can reach."""
    kv = KVPool([SizeClass(64, 4)], num_layers=1, kv_heads=1, head_dim=2)
    cache = PrefixCache(1, 4, kv, num_layers=1, kv_heads=1, head_dim=2)  # a one-block store
    a, b, c = [1] * 4, [2] * 4, [3] * 4

    def start(seq_id: int, prompt: list[int]) -> int:
        pool = kv.allocate(seq_id, 64)
        hit = cache.load(prompt, pool, pool.slot_of(seq_id))
        pool.lengths[seq_id] = len(prompt)
        cache.store(seq_id, prompt)
        return hit

    def end(seq_id: int) -> None:
        cache.retire(seq_id, kv.where[seq_id])
        kv.free(seq_id)

    start(1, a + b + [9, 9])
    assert start(2, a + b + c + [9, 9]) == 8  # a and b from 1's slot; c in its own
    end(1)  # a to the store, b dropped: 2's chain is cut at b
    start(3, [5] * 4 + [9, 9])
    end(3)  # evicts a
    assert start(4, a + b + c + [9, 9]) == 0  # a and b computed again, c still in 2's slot
    end(2)  # c stored: its parents are in 4's slot
    end(4)  # a needs the block c holds: c goes (tail first), a is stored
    pool = kv.allocate(5, 64)
    assert cache.load(a + b + c + [9, 9], pool, pool.slot_of(5)) == 4
