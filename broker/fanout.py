"""The fan-out: the one path a worker's TOKENS batch takes to the job logs and the subscribed clients,
and a job's log takes to the subscribers that lack part of it.

The rules, stated here once. A batch is valid as a whole by the decoder's rules, or dropped whole: it
reaches `relay` decoded strictly, or as it came off the wire, and then relay checks each chunk's plain
shape on the way (protocol.plain_entry), refusing the batch, with nothing changed, at the first one
that fails (the caller then decodes it strictly). Then, for each chunk in order:
1. it counts only if the sending worker runs its job's current attempt (Job.runs); otherwise it is
   stale: dropped (stale_messages_dropped, stale_tokens_dropped);
2. it must start where its job's log ends, with the batch's earlier chunks in it; otherwise
   it is dropped (seq_mismatch): the log never gets a gap or a duplicate;
3. a stored chunk goes to each subscriber whose cursor reaches it. A send that went out moves the
   client's cursors past what it carried; one that did not (a full queue) leaves them, and the jobs are
   `lagging`: `flush` resends from the cursors on the next tick. Nothing is lost;
4. a subscriber gets a job's terminal reply once it has every chunk; then its subscription ends.

Two fast cases of rule 3 change only how much work comes before a send:
- forward: a plain batch whose every chunk rule 2 will store (each its job's next one, no job twice),
  each chunk its job's one subscriber's, the same client for all, who has every earlier chunk (one
  client streaming its jobs). The entries as the worker encoded them then are that client's STREAM
  body: they are sent first, and stored after;
- direct: a job whose one subscriber has every earlier chunk gets the entry just stored added to that
  client's STREAM body, without reading the log back.
Other jobs go through `flush`, after those sends; it reads the cursors as they are then (a send that
found a client gone has cancelled its jobs, which flushed them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

import msgpack
import structlog
import zmq

from tokenmill.broker.clients import ClientTable, Sent
from tokenmill.broker.counters import Counters
from tokenmill.broker.jobs import Job, JobState, JobTable
from tokenmill.protocol import wire as p
from tokenmill.protocol.wire import plain_entry

log = structlog.get_logger("tokenmill.broker")

STREAM_HEAD = [p.HEADER, bytes((p.Cmd.STREAM,))]
_array_header = msgpack.Packer(use_bin_type=True).pack_array_header


class _Body:
    """One client's STREAM body being built: encoded entries, the jobs they belong to and how many chunks
    of each (a job may come twice), and their tokens."""

    __slots__ = ("chunks", "count", "jobs", "parts", "tokens")

    def __init__(self) -> None:
        self.parts: list[bytes | bytearray] = [b""]  # [0]: the array header, set at the send
        self.jobs: list[Job] = []
        self.chunks: list[int] = []
        self.count = 0
        self.tokens = 0

    def add(self, job: Job, entries: bytes | bytearray, chunks: int, tokens: int) -> None:
        self.parts.append(entries)
        self.jobs.append(job)
        self.chunks.append(chunks)
        self.count += chunks
        self.tokens += tokens


class Fanout:
    """Relays TOKENS batches into the job logs and out to subscribers (the module's rules)."""

    def __init__(self, jobs: JobTable, clients: ClientTable, counters: Counters) -> None:
        self.jobs = jobs
        self.clients = clients
        self.counters = counters
        self._batches = 0  # batches relayed (their numbers mark the jobs seen in each: Job.relay_batch)

    def relay(self, worker: bytes, attempts: Sequence[Any], entries: Sequence[Any], body: bytes | None = None,
              offset: int = 0) -> bool:
        """Relay a batch from `worker`: chunk i is attempts[i] and its STREAM entry entries[i] [job_id, seq,
        token_ids, text, logprobs]. Either the batch was decoded strictly (`body` None), or it is as it
        came off the wire, `body[offset:]` the msgpack of `entries`: then each chunk must also have the
        plain shape (protocol.plain_entry, an int attempt in range), checked here on the way; if one has
        not, nothing changes and this returns False (the caller decodes the batch strictly, which says
        what is wrong, and relays it if it is valid). True once relayed.

        A first loop checks each chunk's shape, applies rule 1 and notes whether the batch can be
        forwarded and to whom; it changes nothing. Then the chunks are sent and stored."""
        plain = body is not None
        if plain and (type(attempts) is not list or type(entries) is not list or len(attempts) != len(entries)):
            return False
        get, running, max_attempt = self.jobs.get, JobState.RUNNING, p.MAX_ATTEMPT
        current: list[Job | None] = []  # per chunk: its job if the chunk is current (rule 1), else None
        add = current.append
        client: bytes | None = None  # the one client the whole batch can be forwarded to, while `forwardable`
        forwardable = plain
        stale = stale_tokens = 0
        self._batches = batch = self._batches + 1
        try:
            for attempt, (job_id, seq, token_ids, text, logprobs) in zip(attempts, entries):
                if plain and not (type(attempt) is int and plain_entry(job_id, seq, token_ids, text, logprobs)):
                    raise ValueError("not a plain chunk")
                job = get(job_id)
                # Job.runs, inlined: this loop is the relay's hot path.
                if job is None or job.state is not running or job.worker != worker or job.attempt != attempt:
                    if plain and not 0 <= attempt <= max_attempt:  # (a current attempt is in range)
                        raise ValueError("attempt out of range")
                    stale += 1
                    stale_tokens += len(token_ids)
                    add(None)
                    forwardable = False
                    continue
                add(job)
                if forwardable:  # is this chunk its job's next one, for its one subscriber, who has all others?
                    subs = job.subscribers
                    # (A job twice in a batch: its second chunk is judged with the first one in the log, so
                    # such a batch is not forwarded. Its second chunk repeats the first one's position, which
                    # only an empty first chunk makes valid. A mark on the job, not a set: nothing allocated.)
                    if seq != job.num_tokens or len(subs) != 1 or job.relay_batch == batch:
                        forwardable = False
                        continue
                    job.relay_batch = batch
                    if client is None:
                        client = next(iter(subs))
                    forwardable = subs.get(client) == len(job.ends)
        except (TypeError, ValueError):  # (plain only) an entry that is no plain array of 5: unpacking
            return False  # fails, or (a string or map of 5) the type tests
        if stale:
            self.counters["stale_messages_dropped"] += stale
            self.counters["stale_tokens_dropped"] += stale_tokens
        if forwardable and client is not None:
            assert body is not None
            self._forward(client, current, entries, body[offset:])  # type: ignore[arg-type]
        else:
            self._store_and_send(current, entries)
        return True

    def _forward(self, cid: bytes, current: list[Job], entries: Sequence[Any], stream_body: bytes) -> None:
        """The forward case: send the body as it came, then store the chunks (rule 2 holds for each: that
        was a condition of this case)."""
        error: zmq.ZMQError | None = None
        try:
            status = self.clients.send_raw(cid, [*STREAM_HEAD, stream_body])
        except zmq.ZMQError as e:  # neither a full queue nor a gone peer: re-raised once the chunks are stored
            status, error = Sent.BLOCKED, e
        tokens = 0
        for job, entry in zip(current, entries):
            job.store(entry)
            tokens += len(entry[2])
        self.counters["tokens_in"] += tokens
        self.counters["batches_forwarded"] += 1
        self._delivered(cid, status, current, repeat(1), tokens)
        if error is not None:
            raise error

    def _store_and_send(self, current: list[Job | None], entries: Sequence[Any]) -> None:
        """Rule 2, chunk by chunk: store each current chunk that starts where its job's log ends (else drop
        it). Then rule 3: the direct chunks (a job whose one subscriber has every earlier chunk) go out in
        one body per client, and the other jobs with subscribers are flushed."""
        bodies: dict[bytes, _Body] = {}
        rest: list[Job] = []
        tokens = 0
        for job, entry in zip(current, entries):
            if job is None:
                continue
            seq = entry[1]
            if seq != job.num_tokens:
                self.counters["seq_mismatch"] += 1
                log.warning("seq_mismatch", job=job.job_id, got=seq, expected=job.num_tokens)
                continue
            index = len(job.ends)
            encoded = job.store(entry)
            n = len(entry[2])
            tokens += n
            subs = job.subscribers
            if len(subs) == 1:
                [(cid, cursor)] = subs.items()
                if cursor == index:  # the direct case
                    if (body := bodies.get(cid)) is None:
                        body = bodies[cid] = _Body()
                    body.add(job, encoded, 1, n)
                    continue
            if subs:
                rest.append(job)
        self.counters["tokens_in"] += tokens
        for cid, body in bodies.items():
            self._send(cid, body)
        if rest:
            self.flush(rest)

    def flush(self, jobs: Iterable[Job]) -> None:
        """Send every subscriber of `jobs` the chunks it lacks (one STREAM per client), then the terminal
        reply to those who have all chunks. A STREAM body is an array header plus the jobs' stored
        entries: nothing is re-encoded."""
        jobs = list(dict.fromkeys(jobs))  # a job touched twice is flushed once
        behind: dict[bytes, list[Job]] = {}  # client -> jobs it lacks chunks of
        for job in jobs:
            n = len(job.ends)
            for cid, cursor in job.subscribers.items():
                if cursor < n:
                    if (js := behind.get(cid)) is None:
                        behind[cid] = [job]
                    else:
                        js.append(job)
        for cid, js in behind.items():
            # Cursors are read here, not above: a send that found an earlier client gone can have
            # flushed some of these jobs already (its jobs cancelled -> terminal -> flush).
            body = _Body()
            for job in js:
                cursor = job.subscribers.get(cid)
                n = len(job.ends)
                if cursor is not None and cursor < n:
                    body.add(job, job.entries(cursor), n - cursor, job.tokens_from(cursor))
            if body.jobs:
                self._send(cid, body)
        for job in jobs:
            if job.terminal is not None:
                self._send_terminal(job)

    def _send_terminal(self, job: Job) -> None:
        assert job.terminal is not None
        for cid, cursor in list(job.subscribers.items()):
            if cursor < len(job.ends):
                continue
            if self.clients.send(cid, job.terminal):
                self.clients.unsubscribe(job, cid)
            elif cid in job.subscribers:  # its queue is full (not gone: that ended the subscription)
                self.clients.lagging.add(job.job_id)

    def _send(self, cid: bytes, body: _Body) -> None:
        body.parts[0] = _array_header(body.count)
        status = self.clients.send_raw(cid, [*STREAM_HEAD, b"".join(body.parts)])
        self._delivered(cid, status, body.jobs, body.chunks, body.tokens)

    def _delivered(self, cid: bytes, status: Sent, jobs: list[Job], chunks: Iterable[int], tokens: int) -> None:
        """After a STREAM to `cid` carrying `chunks[i]` chunks of jobs[i] from its cursor: move the
        cursors past them (sent), mark the jobs lagging (queue full), or let the client go (gone)."""
        if status is Sent.SENT:
            self.counters["tokens_out"] += tokens
            for job, k in zip(jobs, chunks):
                try:  # (not contextlib.suppress: this runs per chunk)  # noqa: SIM105
                    job.subscribers[cid] += k
                except KeyError:  # the subscription ended meanwhile (the client left, in a cascade)
                    pass
        elif status is Sent.BLOCKED:
            self.clients.lagging.update(job.job_id for job in jobs)
        else:
            self.clients.on_gone(cid, "unreachable")
