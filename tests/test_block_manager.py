"""The paged KV block manager: hypothesis state machine over allocate / compute / cache / free / preempt /
prefix lookup against a model of its pools, plus unit tests for hash chaining, block sharing by prefix
hits, LRU eviction and the hit counters. Torch-free.

The state machine also models KV *contents*: every slot a request computes is written with that
request's token, a freshly allocated block is garbage (None), and a prefix hit must return blocks
whose contents equal the request's own tokens. So a hash that outlives its block, or a write into a
shared or cached block, fails here and not only as wrong text from the model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.block_manager import ROOT_HASH, BlockManager, extend_block_hashes, hash_block
from tokenmill.worker.request import Request

PARAMS = SamplingParams()
# A few shared token streams: prompts start with a prefix of one of them, so prefix hits are common.
BASES = [[(7 * k + 3 * i + i // 5) % 5 for i in range(80)] for k in range(3)]


def make_request(tokens: list[int], block_size: int, seq: int = 0) -> Request:
    req = Request(f"r{seq}", list(tokens), PARAMS, seed=seq, arrival_seq=seq)
    extend_block_hashes(req, block_size)
    return req


def chained_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The specification of `block_hashes`: each full block hashes its parent's hash and its tokens."""
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        out.append(hash_block(out[-1] if out else ROOT_HASH, tokens[i * block_size : (i + 1) * block_size]))
    return out


# -- plain unit tests ---------------------------------------------------------------------------------


def test_hash_chains_parent_and_tokens() -> None:
    a, b = hash_block(ROOT_HASH, [1, 2]), hash_block(hash_block(ROOT_HASH, [9, 9]), [1, 2])
    assert a != b, "the same block tokens under different parents must hash differently"
    assert a == hash_block(ROOT_HASH, [1, 2])
    assert a != hash_block(ROOT_HASH, [2, 1])
    assert a != hash_block(ROOT_HASH, [1, 2], extra=b"lora-1")
    # Whole requests: equal second blocks, different first blocks -> every later hash differs.
    r1 = make_request([1, 1, 5, 6, 7, 8], 2)
    r2 = make_request([2, 2, 5, 6, 7, 8], 2)
    r3 = make_request([1, 1, 5, 6, 7, 9], 2)
    assert len(r1.block_hashes) == 3
    assert all(x != y for x, y in zip(r1.block_hashes, r2.block_hashes))
    assert r1.block_hashes[:2] == r3.block_hashes[:2] and r1.block_hashes[2] != r3.block_hashes[2]
    assert r1.block_hashes == chained_hashes(r1.token_ids, 2)


def test_extend_block_hashes_covers_output_tokens_and_only_full_blocks() -> None:
    req = make_request([1, 2, 3], 4)
    assert req.block_hashes == []
    req.token_ids.append(4)
    extend_block_hashes(req, 4)
    assert req.block_hashes == chained_hashes([1, 2, 3, 4], 4)
    req.token_ids.extend([5, 6, 7])
    extend_block_hashes(req, 4)
    assert len(req.block_hashes) == 1
    req.token_ids.append(8)
    extend_block_hashes(req, 4)
    assert req.block_hashes == chained_hashes(list(range(1, 9)), 4)


def compute_all(bm: BlockManager, req: Request) -> None:
    assert bm.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_computed_blocks(req)


def test_prefix_hit_shares_a_live_requests_full_blocks_with_refcounts() -> None:
    bm = BlockManager(8, 4)
    first = make_request(list(range(10)), 4, 0)
    compute_all(bm, first)  # 3 blocks: two full (hashed), one partial
    assert bm.num_in_use == 3
    second = make_request([*range(8), 42, 43, 44], 4, 1)
    hits = bm.find_cached_prefix(second)
    assert hits == first.block_ids[:2], "the full blocks of a running request are reusable at once"
    assert bm.allocate(second, second.num_tokens, hits)
    assert [bm._blocks[b].ref_count for b in first.block_ids] == [2, 2, 1]
    assert second.block_ids[2] not in first.block_ids, "the tail is computed in a block of its own"
    bm.check_integrity([first, second])
    bm.free(first)
    assert bm.num_in_use == 3  # the two shared blocks and the second's tail
    assert [bm._blocks[b].ref_count for b in second.block_ids] == [1, 1, 1]
    bm.check_integrity([second])
    bm.free(second)
    assert bm.num_in_use == 0 and bm.num_cached == 2 and bm.num_free == 6
    bm.check_integrity()


def test_prefix_hit_never_covers_last_token_and_counts() -> None:
    bm = BlockManager(16, 4)
    first = make_request(list(range(8)), 4, 0)
    compute_all(bm, first)
    first_ids = list(first.block_ids)
    bm.free(first)
    assert bm.num_cached == 2
    same = make_request(list(range(8)), 4, 1)
    hits = bm.find_cached_prefix(same)
    assert hits == first_ids[:1]
    assert len(hits) == 1, "8 tokens in 2 full blocks: only the first may be reused"
    assert (bm.counters.prefix_cache_queries, bm.counters.prefix_cache_hits) == (1, 1)
    longer = make_request([*range(8), 99, 98], 4, 2)
    assert len(bm.find_cached_prefix(longer)) == 2
    assert (bm.counters.prefix_cache_queries, bm.counters.prefix_cache_hits) == (3, 3)
    other = make_request([0, 1, 2, 7, *range(4, 8), 5], 4, 3)
    assert bm.find_cached_prefix(other) == []
    assert (bm.counters.prefix_cache_queries, bm.counters.prefix_cache_hits) == (5, 3)
    one = make_request([0, 1, 2, 3], 4, 4)
    assert bm.find_cached_prefix(one) == []  # its only block holds its last token
    assert (bm.counters.prefix_cache_queries, bm.counters.prefix_cache_hits) == (5, 3)


def test_adopting_cached_prefix_and_all_or_nothing() -> None:
    bm = BlockManager(4, 2)
    a = make_request([1, 2, 3, 4, 5], 2, 0)
    compute_all(bm, a)  # 3 blocks, two hashed
    bm.free(a)
    assert (bm.num_free, bm.num_cached) == (2, 2)
    b = make_request([1, 2, 3, 4, 6, 7, 8, 9, 10], 2, 1)  # needs 5 blocks: never fits
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    assert not bm.allocate(b, b.num_tokens, hits)
    assert b.block_ids == [] and (bm.num_free, bm.num_cached) == (2, 2)
    bm.check_integrity()
    # 8 tokens = 4 blocks: the two cached ones are adopted, not evicted to make room.
    assert bm.allocate(b, 8, hits)
    assert b.block_ids[:2] == hits and bm.num_in_use == 4
    bm.check_integrity([b])


def test_lru_evicts_least_recently_freed_and_tail_before_head() -> None:
    bm = BlockManager(6, 1)
    a = make_request([10, 11, 12, 13], 1, 0)  # 4 full blocks of size 1
    compute_all(bm, a)
    b = make_request([20, 21], 1, 1)
    compute_all(bm, b)
    a_ids, b_ids = list(a.block_ids), list(b.block_ids)
    bm.free(a)  # evictable now: a3 a2 a1 a0 (tail first)
    bm.free(b)  # then b1 b0
    assert list(bm._evictable) == a_ids[::-1] + b_ids[::-1]
    c = make_request([30, 31, 32], 1, 2)
    assert bm.allocate(c, 3)
    # No free blocks: the three oldest cached ones go, and those are a's tail.
    assert c.block_ids == a_ids[:0:-1]
    assert list(bm._evictable) == [a_ids[0], *b_ids[::-1]]
    d = make_request([10, 11, 12, 13, 14], 1, 3)
    assert bm.find_cached_prefix(d) == a_ids[:1], "a's head block survives, its tail was evicted first"
    # Reusing a cached block and freeing it again makes it the most recently freed.
    assert bm.allocate(d, 1, a_ids[:1])
    bm.free(d)
    assert list(bm._evictable) == [*b_ids[::-1], a_ids[0]]
    e = make_request([40], 1, 4)
    assert bm.allocate(e, 1) and e.block_ids == [b_ids[1]]
    bm.check_integrity([c, e])


def test_prefix_caching_disabled_never_hits_nor_caches() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = make_request([1, 2, 3, 4, 5], 2, 0)
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_cached == 0 and bm.num_free == 8
    assert bm.find_cached_prefix(make_request([1, 2, 3, 4, 5], 2, 1)) == []


def test_duplicate_block_stays_unhashed_and_is_freed() -> None:
    bm = BlockManager(8, 2)
    a, b = make_request([1, 2, 3], 2, 0), make_request([1, 2, 3], 2, 1)
    compute_all(bm, a)
    compute_all(bm, b)  # computed the same prefix separately (admitted at the same time)
    bm.check_integrity([a, b])
    assert bm._blocks[a.block_ids[0]].hash is not None and bm._blocks[b.block_ids[0]].hash is None
    bm.free(b)
    assert bm.num_cached == 0 and bm.num_in_use == 2
    bm.free(a)
    assert bm.num_cached == 1
    bm.check_integrity()


def test_reset_prefix_cache_frees_cached_blocks() -> None:
    bm = BlockManager(4, 2)
    a = make_request([1, 2, 3, 4], 2, 0)
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_cached == 2
    bm.reset_prefix_cache()
    assert (bm.num_free, bm.num_cached) == (4, 0)
    assert bm.find_cached_prefix(make_request([1, 2, 3, 4, 5], 2, 1)) == []
    bm.check_integrity()


# -- the state machine --------------------------------------------------------------------------------


@dataclass
class Snapshot:
    block_ids: list[int]
    num_computed: int
    free: int
    cached: int
    lru: list[int]


class BlockManagerMachine(RuleBasedStateMachine):
    """Model: `lru` is the expected evictable order (oldest first), `kv[b]` the contents of block b,
    `queries`/`hits` the expected counters. Requests in `live` may hold no blocks (waiting/preempted)."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(1, 1)
        self.bs = 1
        self.live: list[Request] = []
        self.lru: list[int] = []
        self.kv: list[list[int | None]] = []
        self.queries = 0
        self.hits = 0
        self.seq = 0

    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 16]),
                caching=st.booleans() | st.just(True))
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.bs = block_size
        self.kv = [[None] * block_size for _ in range(num_blocks)]

    # -- helpers ------------------------------------------------------------------------------------
    def _pick(self, i: int, ok: list[Request] | None = None) -> Request:
        pool = self.live if ok is None else ok
        return pool[i % len(pool)]

    def _snapshot(self, req: Request) -> Snapshot:
        return Snapshot(list(req.block_ids), req.num_computed_tokens, self.bm.num_free, self.bm.num_cached,
                        list(self.lru))

    def _hash_of(self, b: int) -> bytes | None:
        return self.bm._blocks[b].hash

    def _allocate(self, req: Request, target: int, hits: list[int]) -> bool:
        """Allocate through the manager and check the outcome against the model."""
        before = self._snapshot(req)
        revived = [b for b in hits if b in self.lru]
        need = self.bm.blocks_for(target) - len(req.block_ids) - len(hits)
        fits = max(need, 0) <= before.free + before.cached - len(revived)
        ok = self.bm.allocate(req, target, hits)
        assert ok == fits, f"allocate said {ok} with need={need} free={before.free} cached={before.cached}"
        if not ok:  # all or nothing
            assert req.block_ids == before.block_ids
            assert (self.bm.num_free, self.bm.num_cached) == (before.free, before.cached)
            assert all(self._hash_of(b) is not None for b in before.lru), "a failed allocate evicted"
            return False
        assert req.block_ids[: len(before.block_ids)] == before.block_ids
        assert req.block_ids[len(before.block_ids) : len(before.block_ids) + len(hits)] == hits
        fresh = req.block_ids[len(before.block_ids) + len(hits) :]
        assert len(fresh) == max(need, 0)
        self.lru = [b for b in self.lru if b not in revived]
        # Free blocks are used before any cached block is evicted; eviction takes the oldest first.
        num_evicted = max(0, len(fresh) - before.free)
        evicted, self.lru = self.lru[:num_evicted], self.lru[num_evicted:]
        assert fresh[len(fresh) - num_evicted :] == evicted, "eviction is not least-recently-freed first"
        assert not set(fresh[: len(fresh) - num_evicted]) & set(before.lru), "evicted with free blocks left"
        for b in fresh:
            assert self._hash_of(b) is None, f"a reused block {b} kept its hash"
            assert self.bm._blocks[b].ref_count == 1
            self.kv[b] = [None] * self.bs  # garbage until written
        return True

    def _drop(self, req: Request) -> None:
        """Model of free(): refs drop tail first; a hashed block reaching 0 joins the LRU's young end."""
        refs = self._refs()
        for b in reversed(req.block_ids):
            refs[b] -= 1
            if refs[b] == 0 and self._hash_of(b) is not None:
                self.lru.append(b)
        in_use = self.bm.num_in_use
        released = sum(1 for b in req.block_ids if refs[b] == 0)
        self.bm.free(req)
        assert req.block_ids == []
        assert self.bm.num_in_use == in_use - released

    def _refs(self) -> list[int]:
        refs = [0] * self.bm.num_blocks
        for r in self.live:
            for b in r.block_ids:
                refs[b] += 1
        return refs

    # -- rules ----------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.live) < 8)
    @rule(base=st.integers(0, len(BASES) - 1), prefix=st.integers(0, 48),
          suffix=st.lists(st.integers(0, 4), max_size=24))
    def add_request(self, base: int, prefix: int, suffix: list[int]) -> None:
        tokens = BASES[base][:prefix] + suffix or [0]
        self.seq += 1
        req = make_request(tokens, self.bs, self.seq)
        self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), extra=st.integers(1, 40))
    def allocate(self, i: int, extra: int) -> None:
        req = self._pick(i)
        self._allocate(req, min(req.num_tokens, req.num_computed_tokens + extra), [])

    @precondition(lambda self: any(not r.block_ids for r in self.live))
    @rule(i=st.integers(0, 99), extra=st.integers(1, 40))
    def lookup_and_allocate(self, i: int, extra: int) -> None:
        self._lookup_and_allocate(self._pick(i, [r for r in self.live if not r.block_ids]), extra)

    @precondition(lambda self: any(r.num_computed_tokens < min(r.num_tokens, len(r.block_ids) * self.bs)
                                   for r in self.live))
    @rule(i=st.integers(0, 99), n=st.integers(1, 40))
    def compute(self, i: int, n: int) -> None:
        ok = [r for r in self.live if r.num_computed_tokens < min(r.num_tokens, len(r.block_ids) * self.bs)]
        self._compute(self._pick(i, ok), n)

    @precondition(lambda self: len(self.live) < 8)
    @rule(base=st.integers(0, len(BASES) - 1), prefix=st.integers(0, 48),
          suffix=st.lists(st.integers(0, 4), max_size=8), keep=st.booleans())
    def serve_request(self, base: int, prefix: int, suffix: list[int], keep: bool) -> None:
        """A whole request's life in one rule (lookup, allocate, compute all, maybe free), so that
        prefix hits and evictions are common within a few steps."""
        self.add_request(base, prefix, suffix)
        req = self.live[-1]
        if self._lookup_and_allocate(req, req.num_tokens):
            self._compute(req, req.num_tokens)
        if not keep:
            self.free(len(self.live) - 1)

    def _lookup_and_allocate(self, req: Request, extra: int) -> bool:
        assert req.num_computed_tokens == 0 and not req.block_ids
        hits = self.bm.find_cached_prefix(req)
        max_blocks = (req.num_tokens - 1) // self.bs
        if self.bm.enable_prefix_caching:
            self.queries += min(max_blocks, len(req.block_hashes))
            self.hits += len(hits)
        assert len(hits) * self.bs <= req.num_tokens - 1, "a prefix hit covered the last token"
        for j, b in enumerate(hits):
            assert self._hash_of(b) == req.block_hashes[j], "hit block's hash is not the request's chain"
            assert self.kv[b] == req.token_ids[j * self.bs : (j + 1) * self.bs], "hit block holds other KV"
        if self.bm.enable_prefix_caching and len(hits) < max_blocks:
            assert req.block_hashes[len(hits)] not in self.bm._by_hash, "the hit is not the longest prefix"
        target = min(req.num_tokens, len(hits) * self.bs + extra)
        if not self._allocate(req, target, hits):
            return False
        req.num_computed_tokens = len(hits) * self.bs
        return True

    def _compute(self, req: Request, n: int) -> None:
        """The model writes the next `n` tokens' KV into the request's blocks, then the manager caches."""
        end = min(req.num_computed_tokens + n, req.num_tokens, len(req.block_ids) * self.bs)
        for pos in range(req.num_computed_tokens, end):
            b = req.block_ids[pos // self.bs]
            assert self.bm._blocks[b].ref_count == 1, f"writing block {b} shared with another request"
            assert self._hash_of(b) is None, f"writing block {b} that is registered in the prefix cache"
            self.kv[b][pos % self.bs] = req.token_ids[pos]
        req.num_computed_tokens = end
        self.bm.cache_computed_blocks(req)
        for j in range(req.num_computed_tokens // self.bs if self.bm.enable_prefix_caching else 0):
            h, b = req.block_hashes[j], req.block_ids[j]
            assert self._hash_of(b) == h or (self._hash_of(b) is None and h in self.bm._by_hash), \
                "a fully computed block is neither registered nor a duplicate of a registered one"

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), tokens=st.lists(st.integers(0, 4), min_size=1, max_size=6))
    def append_tokens(self, i: int, tokens: list[int]) -> None:
        req = self._pick(i)
        req.token_ids.extend(tokens)
        extend_block_hashes(req, self.bs)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        req = self._pick(i)
        self._drop(req)
        self.live.remove(req)

    @precondition(lambda self: any(r.block_ids for r in self.live))
    @rule(i=st.integers(0, 99))
    def preempt(self, i: int) -> None:
        req = self._pick(i, [r for r in self.live if r.block_ids])
        self._drop(req)
        req.num_computed_tokens = 0

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()
        self.lru = []
        assert self.bm.num_cached == 0

    # -- invariants -----------------------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        bm = self.bm
        bm.check_integrity(self.live)
        assert bm.num_free + bm.num_cached + bm.num_in_use == bm.num_blocks
        refs = self._refs()
        assert bm.num_in_use == sum(1 for r in refs if r > 0), "a block is in use with no owner (leak)"
        assert list(bm._evictable) == self.lru, "evictable order differs from least-recently-freed"
        assert (bm.counters.prefix_cache_queries, bm.counters.prefix_cache_hits) == (self.queries, self.hits)
        for r in self.live:
            assert r.block_hashes == chained_hashes(r.token_ids, self.bs)
            assert r.num_computed_tokens <= min(r.num_tokens, len(r.block_ids) * self.bs)

    def teardown(self) -> None:
        for r in list(self.live):
            self._drop(r)
            self.live.remove(r)
        assert self.bm.num_in_use == 0, "blocks leaked after every request was freed"
        self.bm.check_integrity()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_block_manager_state_machine = BlockManagerMachine.TestCase


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_all_freed_means_nothing_in_use(block_size: int) -> None:
    bm = BlockManager(24, block_size)
    reqs = [make_request(BASES[k % 3][: 5 + 7 * k], block_size, k) for k in range(6)]
    for r in reqs:
        hits = bm.find_cached_prefix(r)
        if bm.allocate(r, r.num_tokens, hits):
            r.num_computed_tokens = r.num_tokens
            bm.cache_computed_blocks(r)
        bm.check_integrity(reqs)
    for r in reqs:
        bm.free(r)
    assert bm.num_in_use == 0
    bm.check_integrity()


def test_a_preempted_request_registers_its_blocks_again() -> None:
    """cache_computed_blocks looks at each block once (a cursor on the request); freeing the request resets it,
    so after a preemption the blocks it computes anew are registered again."""
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    req = make_request([1, 2, 3, 4, 5], 2)
    assert bm.allocate(req, 5)
    req.num_computed_tokens = 5
    bm.cache_computed_blocks(req)
    assert req.num_hashed_blocks == 2
    assert bm.find_cached_prefix(make_request([1, 2, 3, 4, 5], 2, 1)) == req.block_ids[:2]
    bm.free(req)  # preempted
    bm.reset_prefix_cache()  # its cached blocks are gone
    assert req.num_hashed_blocks == 0 and bm.find_cached_prefix(make_request([1, 2, 3, 4, 5], 2, 2)) == []
    req.num_computed_tokens = 0
    assert bm.allocate(req, 5)
    req.num_computed_tokens = 5
    bm.cache_computed_blocks(req)
    assert bm.find_cached_prefix(make_request([1, 2, 3, 4, 5], 2, 3)) == req.block_ids[:2]
    bm.check_integrity([req])


def test_a_duplicate_block_is_registered_once_the_other_copy_is_gone() -> None:
    """Two requests compute the same block; the second copy stays unhashed (a duplicate). When the first copy
    leaves the cache (here reset_prefix_cache after its request is freed), the second's next commit registers
    it: the cursor stops at the first duplicate (found by the state machine above)."""
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    first, second = make_request([7, 8, 9], 2, 0), make_request([7, 8, 1], 2, 1)
    for r in (first, second):
        assert bm.allocate(r, 3)
        r.num_computed_tokens = 2
        bm.cache_computed_blocks(r)
    assert bm._blocks[second.block_ids[0]].hash is None, "the second copy is a duplicate"
    bm.free(first)
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(make_request([7, 8, 5], 2, 2)) == []
    second.num_computed_tokens = 3
    bm.cache_computed_blocks(second)
    assert bm.find_cached_prefix(make_request([7, 8, 5], 2, 3)) == second.block_ids[:1]
    bm.check_integrity([second])
