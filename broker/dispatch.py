"""Dispatch policy: which worker a queued job starts on. The broker holds one Dispatcher object and asks
it, for each job at the head of its model's queue, to pick among the workers that serve the job's model.

The default policy, `AffinityDispatcher`: model match, then load, with prefix affinity. A prompt's
leading text is cut into fixed-size chunks and hashed cumulatively (h_k covers chunks 1..k: equal h_k
means an equal k-chunk prefix; a job carries its hashes, `Job.prefix_hashes`). The index remembers which
worker last served each h_k (LRU-bounded). A job goes to the worker with the longest remembered prefix
while that worker's load is within `slack` of the least-loaded candidate; otherwise to the least loaded
one (whose KV cache then learns the prefix). This is the cache-aware idea of SGLang's router / llm-d's
prefix scorer, approximated on text because the broker has no tokenizer.

Disaggregated prefill and decode (`Dispatcher.place`, the same for every policy unless one overrides it):
when the workers that serve a job's model include a "prefill" and a "decode" worker (Ready.role), a new job
is placed on both: `pick` chooses the prefill worker (so prefix affinity follows the prompt's KV cache) and
the least-loaded decode worker streams the tokens (a prompt of token ids too short to fill one KV block has
nothing to hand over: it runs whole on that decode worker). Otherwise the job goes to one worker as before: a "both"
worker, or, when no worker of that role serves the model, any worker (every role can run a whole job).
"""

from __future__ import annotations

import abc
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from tokenmill.broker.jobs import Job
from tokenmill.broker.workers import WorkerInfo


class Placement(NamedTuple):
    """Where a job's attempt runs: `worker` runs it and streams its tokens; `prefill`, if set, computes its
    prompt's KV blocks first and hands them to `worker` (disaggregated prefill and decode)."""

    worker: WorkerInfo
    prefill: WorkerInfo | None = None


class Dispatcher(abc.ABC):
    """A routing policy. The broker calls `pick` for a queued job and starts the job on the worker it
    returns (so a policy may record the choice), or leaves the job and every later one of its model
    queued when it returns None (no worker can take it now)."""

    @abc.abstractmethod
    def pick(self, job: Job, workers: Sequence[WorkerInfo]) -> WorkerInfo | None:
        """The worker to start `job` on, among `workers` (the registered workers that serve its model,
        with room or not), or None."""

    def place(self, job: Job, workers: Sequence[WorkerInfo]) -> Placement | None:
        """Where to start `job` among `workers` (as for `pick`), with a prefill worker when the pool is
        disaggregated (module docstring); None: no worker can take it now."""
        prefill = [w for w in workers if w.role == "prefill"]
        decode = [w for w in workers if w.role == "decode" and w.kv_address]
        if prefill and decode:  # disaggregated: wait for room on both sides
            room = [w for w in decode if w.has_room()]
            d = min(room, key=lambda w: (w.load_score(), w.dispatched)) if room else None
            if d is not None and len(job.input.prompt_token_ids or ()) in range(1, d.block_size + 1):
                return Placement(d)
            p = self.pick(job, prefill) if d is not None else None
            return Placement(d, p) if d is not None and p is not None else None
        both = [w for w in workers if w.role == "both"]
        w = self.pick(job, both or workers)
        return Placement(w) if w is not None else None

    def stats(self) -> dict[str, object]:
        """What the policy adds to the broker's STATS reply (top-level keys)."""
        return {}


def prefix_hashes(text: str, chunk_chars: int, max_chunks: int) -> list[bytes]:
    """h_1..h_k of the full leading `chunk_chars`-character chunks of `text` (at most `max_chunks`; a
    short tail chunk is ignored)."""
    out: list[bytes] = []
    h = b""
    for k in range(min(len(text) // chunk_chars, max_chunks)):
        chunk = text[k * chunk_chars:(k + 1) * chunk_chars]
        h = hashlib.blake2b(h + chunk.encode("utf-8", "surrogatepass"), digest_size=12).digest()
        out.append(h)
    return out


class PrefixIndex:
    """LRU map from cumulative prefix-chunk hashes to the worker that last served that prefix."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[bytes, bytes] = OrderedDict()

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


class AffinityDispatcher(Dispatcher):
    """The default policy (module docstring): among workers with room, the longest prefix match within
    `slack` of the lowest load, else the lowest load (ties: the one dispatched to least, which spreads
    work round-robin). Records each pick's prefix for the next jobs."""

    def __init__(self, slack: float = 0.25, index: PrefixIndex | None = None) -> None:
        self.slack = slack
        self.index = index if index is not None else PrefixIndex()

    def pick(self, job: Job, workers: Sequence[WorkerInfo]) -> WorkerInfo | None:
        w = self._choose(job.prefix_hashes, workers)
        if w is not None:
            self.index.record(job.prefix_hashes, w.ident)
        return w

    def _choose(self, hashes: list[bytes], workers: Sequence[WorkerInfo]) -> WorkerInfo | None:
        room = [w for w in workers if w.has_room()]
        if not room:
            return None
        scores = {w.ident: w.load_score() for w in room}
        lowest = min(scores.values())
        if hashes:
            matches = self.index.match(hashes)
            affine = [w for w in room if matches.get(w.ident) and scores[w.ident] <= lowest + self.slack]
            if affine:
                return max(affine, key=lambda w: (matches[w.ident], -scores[w.ident]))
        return min(room, key=lambda w: (scores[w.ident], w.dispatched))

    def stats(self) -> dict[str, object]:
        return {"prefix_entries": len(self.index)}
