"""Worker registry and dispatch policy: model match, then load, with prefix affinity.

Prefix affinity: a prompt's leading text is cut into fixed-size chunks and hashed cumulatively
(h_k covers chunks 1..k), so equal h_k means an equal k-chunk prefix. The index remembers which worker
last served each h_k (LRU-bounded). A job goes to the worker with the longest remembered prefix while
that worker's load is within `slack` of the least-loaded candidate; otherwise to the least loaded one
(whose KV cache then learns the prefix). This is the cache-aware idea of SGLang's router / llm-d's
prefix scorer, approximated on text because the broker has no tokenizer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.protocol.wire import Ready, WorkerHeartbeat


@dataclass(eq=False)
class WorkerInfo:
    """What the broker knows about one registered worker (keyed by its routing id; its output may also
    come from its data socket, `data_ident`, b"" if none)."""

    ident: bytes
    name: str
    models: frozenset[str]
    capacity: int  # jobs the broker may have in flight on it at once
    kv_blocks: int
    block_size: int
    max_model_len: int
    interval: float  # heartbeat interval both ways, announced by the worker
    last_seen: float
    next_heartbeat: float
    jobs: set[str] = field(default_factory=set)  # job ids whose current attempt runs here
    load: WorkerHeartbeat = field(default_factory=WorkerHeartbeat)
    dispatched: int = 0
    data_ident: bytes = b""
    max_prompt_chars: int = 0  # Ready.max_prompt_chars: longer text never fits (0: no bound known)

    @classmethod
    def from_ready(cls, ident: bytes, msg: Ready, now: float) -> WorkerInfo:
        return cls(ident, msg.name, frozenset(msg.models), msg.capacity, msg.kv_blocks, msg.block_size,
                   msg.max_model_len, msg.heartbeat_interval, now, now, load=WorkerHeartbeat(0, 0, msg.kv_blocks, 0),
                   data_ident=msg.data_id.encode(), max_prompt_chars=msg.max_prompt_chars)

    def serves(self, model: str) -> bool:
        """An empty model name means "any model"."""
        return not model or model in self.models

    def has_room(self) -> bool:
        return len(self.jobs) < self.capacity

    def load_score(self) -> float:
        """Lower is better: share of capacity in use, plus KV pressure from the last heartbeat."""
        busy = len(self.jobs) / self.capacity
        if self.kv_blocks > 0:
            free = (self.load.free_blocks + self.load.cached_blocks) / self.kv_blocks
            busy += 0.5 * max(0.0, 1.0 - free)
        return busy

    def describe(self, now: float) -> dict[str, object]:
        return {"name": self.name, "models": sorted(self.models), "capacity": self.capacity,
                "inflight": len(self.jobs), "kv_blocks": self.kv_blocks, "block_size": self.block_size,
                "max_model_len": self.max_model_len, "max_prompt_chars": self.max_prompt_chars,
                "running": self.load.running, "waiting": self.load.waiting,
                "free_blocks": self.load.free_blocks, "cached_blocks": self.load.cached_blocks,
                "dispatched": self.dispatched, "last_seen_ago": round(now - self.last_seen, 3),
                # cumulative counters from the worker's heartbeat (the gateway's /health and /metrics)
                "steps": self.load.steps, "prefix_queries": self.load.prefix_queries,
                "prefix_hits": self.load.prefix_hits, "preemptions": self.load.preemptions}


class PrefixIndex:
    """LRU map from cumulative prefix-chunk hashes to the worker that last served that prefix."""

    def __init__(self, chunk_chars: int = 128, max_chunks: int = 32, capacity: int = 100_000) -> None:
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.capacity = capacity
        self._owner: OrderedDict[bytes, bytes] = OrderedDict()

    def hashes(self, text: str) -> list[bytes]:
        """h_1..h_k of the full leading chunks of `text` (a short tail chunk is ignored)."""
        out: list[bytes] = []
        h = b""
        n = min(len(text) // self.chunk_chars, self.max_chunks)
        for k in range(n):
            chunk = text[k * self.chunk_chars:(k + 1) * self.chunk_chars]
            h = hashlib.blake2b(h + chunk.encode("utf-8", "surrogatepass"), digest_size=12).digest()
            out.append(h)
        return out

    def match(self, hashes: list[bytes]) -> dict[bytes, int]:
        """For each worker, the number of leading chunks of the longest prefix it served."""
        best: dict[bytes, int] = {}
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is not None and owner not in best:
                best[owner] = depth
        return best

    def record(self, hashes: list[bytes], worker: bytes) -> None:
        for h in hashes:
            self._owner[h] = worker
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owner)


def pick_worker(candidates: Iterable[WorkerInfo], hashes: list[bytes], index: PrefixIndex,
                slack: float) -> WorkerInfo | None:
    """Choose among workers with room: longest prefix match within `slack` of the lowest load, else
    the lowest load (ties: the one dispatched to least, which spreads work round-robin)."""
    room = [w for w in candidates if w.has_room()]
    if not room:
        return None
    scores = {w.ident: w.load_score() for w in room}
    lowest = min(scores.values())
    if hashes:
        matches = index.match(hashes)
        affine = [w for w in room if matches.get(w.ident) and scores[w.ident] <= lowest + slack]
        if affine:
            return max(affine, key=lambda w: (matches[w.ident], -scores[w.ident]))
    return min(room, key=lambda w: (scores[w.ident], w.dispatched))
