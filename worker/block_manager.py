"""Paged KV-cache block accounting with reference counts and prefix caching. Torch-free.

Every block is in exactly one of three states:
  free      ref_count == 0, no hash        (in `_free`, reused first)
  cached    ref_count == 0, hash set       (in `_evictable`, LRU order, reusable by a prefix hit)
  in use    ref_count  > 0                 (owned by one or more requests)
so `num_free + num_cached + num_in_use == num_blocks` always (`check_integrity`).

A full block's hash chains its parent's hash and its token ids (plus optional extra keys), so equal
hashes mean equal whole prefixes, not just equal blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.worker.metrics import EngineCounters
from tokenmill.worker.request import Request

ROOT_HASH = b"tokenmill-prefix-v1"


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def extend_block_hashes(req: Request, block_size: int, extra: bytes = b"") -> None:
    """Append hashes for every newly full block of `req.token_ids` (prompt and known output alike: a
    token still in flight is not hashed)."""
    while (len(req.block_hashes) + 1) * block_size <= req.num_known_tokens:
        i = len(req.block_hashes)
        parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
        tokens = req.token_ids[i * block_size : (i + 1) * block_size]
        req.block_hashes.append(hash_block(parent, tokens, extra))


def prefix_hashes(tokens: Sequence[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """The chained hashes of the full blocks of `tokens` (as extend_block_hashes gives a request)."""
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        out.append(hash_block(out[-1] if out else ROOT_HASH, tokens[i * block_size : (i + 1) * block_size], extra))
    return out


@dataclass
class _Block:
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 counters: EngineCounters | None = None) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: low ids handed out first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._by_hash: dict[bytes, int] = {}
        self.counters = counters if counters is not None else EngineCounters()  # prefix-cache lookups

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free ones and evictable cached ones."""
        return self.num_free + self.num_cached

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of `req`, never covering its last token (that
        token must be computed to produce logits). Counts queries and hits; takes no reference."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        self.counters.prefix_cache_queries += min(max_blocks, len(req.block_hashes))
        self.counters.prefix_cache_hits += len(hits)
        return hits

    # -- KV blocks moved between workers (worker/kv_transfer/) ------------------------------------
    def cached_chain(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of the hash chain `hashes` (no counters, no reference)."""
        out: list[int] = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def import_chain(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """Make the longest possible prefix of the hash chain `hashes` cached here: blocks already cached are
        kept, each missing one gets a fresh block (hashed, ref 0, most recently used). Returns (chain index,
        block id) of the fresh blocks, whose contents the caller must write before the next step reads them.
        Stops at the first block none is available for. Invariants hold throughout (check_integrity)."""
        held: list[int] = []  # referenced while importing: nothing of the chain is evicted meanwhile
        fresh: list[tuple[int, int]] = []
        for i, h in enumerate(hashes):
            b = self._by_hash.get(h)
            if b is None:
                if self.num_available == 0:
                    break
                b = self._pop_block()
                self._blocks[b].hash = h
                self._by_hash[h] = b
                fresh.append((i, b))
            else:
                self._take_ref(b)
            held.append(b)
        for b in reversed(held):  # the chain's tail becomes evictable first, as in free()
            self._drop_ref(b)
        return fresh

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, req: Request, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Make `req.block_ids` cover `num_tokens` tokens, first adopting `cached_prefix` (only when
        the request holds no blocks yet). All or nothing: returns False and changes nothing when
        there are not enough blocks."""
        assert not cached_prefix or not req.block_ids
        need = self.blocks_for(num_tokens) - len(req.block_ids) - len(cached_prefix)
        # Adopting a cached (ref 0) block removes it from the evictable pool.
        revived = sum(1 for b in cached_prefix if self._blocks[b].ref_count == 0)
        if max(need, 0) > self.num_available - revived:
            return False
        for b in cached_prefix:
            self._take_ref(b)
        req.block_ids.extend(cached_prefix)
        for _ in range(need):
            req.block_ids.append(self._pop_block())
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the hashes of `req`'s fully computed blocks so later requests can reuse them. The walk starts
        at `req.num_hashed_blocks`, the first block not yet settled: a step costs the blocks it completed, not the
        prefix. A duplicate (its hash registered by another block) stays unhashed and is freed normally; the
        cursor stops at the first one, so it is registered on a later step once the other copy is evicted."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(req.block_ids))
        first_duplicate = num_full
        for i in range(min(req.num_hashed_blocks, num_full), num_full):
            block = self._blocks[req.block_ids[i]]
            if block.hash is not None:  # adopted from the cache, or registered on an earlier step
                continue
            h = req.block_hashes[i]
            if h not in self._by_hash:
                block.hash = h
                self._by_hash[h] = req.block_ids[i]
            else:
                first_duplicate = min(first_duplicate, i)
        req.num_hashed_blocks = first_duplicate

    def free(self, req: Request) -> None:
        """Drop `req`'s references. Tail blocks become evictable first, so LRU eviction takes the
        end of a prefix before its start."""
        for b in reversed(req.block_ids):
            self._drop_ref(b)
        req.block_ids = []
        req.num_hashed_blocks = 0

    def release_tail(self, req: Request, num_tokens: int) -> None:
        """Drop `req`'s blocks past the first blocks_for(num_tokens) (taken for draft tokens that were
        rejected: they hold no known token, so they are neither hashed nor shared)."""
        keep = self.blocks_for(num_tokens)
        for b in reversed(req.block_ids[keep:]):
            assert self._blocks[b].ref_count == 1 and self._blocks[b].hash is None, f"tail block {b} is shared"
            self._drop_ref(b)
        del req.block_ids[keep:]

    def reset_prefix_cache(self) -> None:
        for b in list(self._evictable):
            self._unhash(b)
            del self._evictable[b]
            self._free.append(b)

    # -- internals ------------------------------------------------------------------------------
    def _pop_block(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            self._unhash(b)
        self._blocks[b].ref_count = 1
        return b

    def _take_ref(self, b: int) -> None:
        block = self._blocks[b]
        if block.ref_count == 0:
            assert block.hash is not None, "only cached blocks are adopted at ref 0"
            del self._evictable[b]
        block.ref_count += 1

    def _drop_ref(self, b: int) -> None:
        block = self._blocks[b]
        assert block.ref_count > 0, f"block {b} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def _unhash(self, b: int) -> None:
        block = self._blocks[b]
        if block.hash is not None:
            if self._by_hash.get(block.hash) == b:
                del self._by_hash[block.hash]
            block.hash = None

    def check_integrity(self, requests: Sequence[Request] = ()) -> None:
        """Assert the three-state invariant; with `requests` (all live ones), also that reference
        counts equal the number of requests holding each block."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and cached"
        assert self.num_free + self.num_cached + self.num_in_use == self.num_blocks
        for i, block in enumerate(self._blocks):
            if i in free:
                assert block.ref_count == 0 and block.hash is None, f"free block {i} is referenced or hashed"
            elif i in evictable:
                assert block.ref_count == 0 and block.hash is not None, f"cached block {i} is bad"
            else:
                assert block.ref_count > 0, f"block {i} is lost: in no pool and unreferenced"
            if block.hash is not None:
                assert self._by_hash.get(block.hash) == i, f"hash index disagrees on block {i}"
        assert len(self._by_hash) == sum(b.hash is not None for b in self._blocks)
        if requests:
            refs = [0] * self.num_blocks
            for r in requests:
                for b in r.block_ids:
                    refs[b] += 1
            assert refs == [b.ref_count for b in self._blocks], "reference counts disagree with owners"
