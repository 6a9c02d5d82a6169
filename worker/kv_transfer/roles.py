"""The engine loop's part of disaggregated serving (worker/process.py drives it; the package docstring has
the picture). One object per worker, used from the engine loop's thread only.

Prefill side (a SUBMIT with `kv_send`): the job runs as a request of one output token, whose output is not
emitted; when it finishes, the KV of its full prompt blocks goes to the decode worker and PREFILLED (with
the number of blocks sent, 0 when none could be) to the broker. An ERROR the loop would send for such a job
becomes PREFILLED 0: the decode worker computes the prompt and answers for the job itself.

Decode side (a SUBMIT with `kv_wait`): the job waits, without touching the engine, until its KV arrives
(imported into the prefix cache), KV_LOST comes, a KV message for it cannot be used, or `kv_timeout` passes;
then it is submitted as any other job. KV that arrives before its job is imported all the same (and the job
then starts at once when it comes)."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from tokenmill.protocol import SamplingParams
from tokenmill.protocol import wire as p
from tokenmill.worker.kv_transfer.blocks import as_buffer, stage_in
from tokenmill.worker.kv_transfer.channel import KVArrival, KVReceiver, KVSender
from tokenmill.worker.kv_transfer.frames import KVHeader, check_payload, encode_kv

log = structlog.get_logger("tokenmill.kv_transfer")

_EARLY_KEPT = 10_000  # ids of KV messages that came before their job, remembered at most


@dataclasses.dataclass(eq=False)
class _Prefill:
    job_id: str
    attempt: int
    target: str  # the decode worker's KV address
    token_ids: list[int] = dataclasses.field(default_factory=list)  # prompt (+ resumed output) of the request


class KVRoles:
    """See the module docstring. `push` sends a message to the broker (the loop's data socket);
    `on_arrival` gets each received KV message on the receiver's thread (the loop's inbound queue)."""

    def __init__(self, engine: Any, role: str, push: Callable[[p.Message], None], ctx: zmq.Context,
                 on_arrival: Callable[[KVArrival], None], kv_bind: str, kv_timeout: float) -> None:
        assert role in p.WORKER_ROLES
        self.engine, self.role, self.push, self.kv_timeout = engine, role, push, kv_timeout
        if role != "both" and not getattr(getattr(engine, "blocks", None), "enable_prefix_caching", False):
            raise ValueError(f"a {role} worker needs an engine with prefix caching on (KV blocks are handed "
                             "over through the prefix cache)")
        self.prefills: dict[str, _Prefill] = {}  # engine request id -> the prefill it runs
        self.waiting: dict[str, tuple[p.WorkerSubmit, float]] = {}  # request id -> (job, deadline)
        self._early: OrderedDict[str, None] = OrderedDict()
        self.counts = {"kv_sent": 0, "kv_send_failed": 0, "kv_imported": 0, "kv_unusable": 0, "kv_lost": 0,
                       "kv_timeouts": 0}
        self.geometry = engine.kv_geometry() if role != "both" else None
        self.sender = KVSender(ctx) if role == "prefill" else None
        self.receiver: KVReceiver | None = None
        if role == "decode":
            assert self.geometry is not None
            max_bytes = self.geometry.payload_bytes(engine.blocks.num_blocks) + (16 << 20)
            device = engine.runner.device
            self.receiver = KVReceiver(ctx, kv_bind, lambda a: on_arrival(self._staged(a, device)), max_bytes)
            self.receiver.start()

    @property
    def address(self) -> str:
        """Where this worker receives KV blocks ("" unless it decodes)."""
        return self.receiver.address if self.receiver is not None else ""

    def check(self) -> None:
        """Raise what failed in the receiver's thread."""
        if self.receiver is not None and self.receiver.error is not None:
            raise RuntimeError("worker KV receiver failed") from self.receiver.error

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()
            self.receiver.join(2.0)
        if self.sender is not None:
            self.sender.close()

    def forget(self, rid: str) -> None:
        """The job's attempt was cancelled (or the loop reset): nothing more is done for it."""
        self.prefills.pop(rid, None)
        self.waiting.pop(rid, None)

    def reset(self) -> None:
        self.prefills.clear()
        self.waiting.clear()

    # -- prefill side ---------------------------------------------------------------------------------
    def prefill_params(self, rid: str, msg: p.WorkerSubmit, params: SamplingParams) -> SamplingParams:
        """Start a prefill for the job: the params of a request that computes the prompt and one token."""
        self.prefills[rid] = _Prefill(msg.job_id, msg.attempt, msg.kv_send)
        return dataclasses.replace(params, max_tokens=len(msg.resume_token_ids) + 1, min_tokens=0, stop=(),
                                   logprobs=None, num_speculative_tokens=0)

    def added(self, rid: str) -> None:
        """The request is in the engine: remember the tokens whose KV it computes."""
        if (pf := self.prefills.get(rid)) is not None:
            pf.token_ids = self.engine.request_token_ids(rid)

    def converted(self, msg: p.Message) -> p.Message:
        """An ERROR for a prefill job becomes PREFILLED 0 (the decode worker answers for the job)."""
        if isinstance(msg, p.JobError) and (pf := self.prefills.pop(f"{msg.job_id}#{msg.attempt}", None)):
            log.info("prefill_failed", job=pf.job_id, error=msg.message[:200])
            return p.Prefilled(pf.job_id, pf.attempt, 0)
        return msg

    def take_outputs(self, outputs: list[Any], active: dict[str, Any]) -> list[Any]:
        """The step's outputs less those of prefill jobs; each finished prefill sends its KV."""
        rest = []
        for out in outputs:
            if out.request_id not in self.prefills:
                rest.append(out)
            elif out.finished:
                active.pop(out.request_id, None)
                self._send_kv(self.prefills.pop(out.request_id), out.error)
        return rest

    def _send_kv(self, pf: _Prefill, error: str | None) -> None:
        blocks = 0
        try:
            got = self.engine.export_prefix_kv(pf.token_ids) if error is None and pf.token_ids else None
            if got is not None:
                ids, kv = got
                assert self.sender is not None and self.geometry is not None
                header = KVHeader(pf.job_id, pf.attempt, ids, self.geometry)
                if self.sender.send(pf.target, encode_kv(header, as_buffer(kv))):
                    blocks = header.blocks
        except Exception:  # the decode worker computes the prompt instead: nothing is lost
            log.exception("kv_export_failed", job=pf.job_id)
        self.counts["kv_sent" if blocks else "kv_send_failed"] += 1
        self.push(p.Prefilled(pf.job_id, pf.attempt, blocks))

    # -- decode side ----------------------------------------------------------------------------------
    def park(self, msg: p.WorkerSubmit) -> bool:
        """Whether the job waits for its KV (False: it starts now, as any job)."""
        rid = f"{msg.job_id}#{msg.attempt}"
        if not msg.kv_wait or self.receiver is None:
            return False
        if rid in self._early:  # its KV came first (imported, or unusable): start now
            del self._early[rid]
            return False
        self.waiting[rid] = (msg, time.monotonic() + self.kv_timeout)
        return True

    def _staged(self, a: KVArrival, device: Any) -> KVArrival:
        """On the receiver's thread: the arrival checked against this cache and staged for import."""
        assert self.geometry is not None
        why = check_payload(a.header, a.payload.nbytes, self.geometry)
        if why is not None:
            return dataclasses.replace(a, error=why)
        try:
            kv = stage_in(a.payload, self.geometry.payload_shape(a.header.blocks), self.geometry.dtype, device)
        except Exception as e:  # e.g. no pinned memory left: the decode worker computes the prompt
            return dataclasses.replace(a, error=f"staging failed: {type(e).__name__}: {e}"[:300])
        return dataclasses.replace(a, payload=None, kv=kv)

    def arrived(self, a: KVArrival) -> p.WorkerSubmit | None:
        """Import a staged KV message; the job it was for, if that job waits for it (to submit now)."""
        h = a.header
        if a.error is None:
            cached = self.engine.import_prefix_kv(h.token_ids, a.kv)
            self.counts["kv_imported"] += 1
            log.debug("kv_imported", job=h.job_id, blocks=h.blocks, cached=cached)
        else:
            self.counts["kv_unusable"] += 1
            log.warning("kv_unusable", job=h.job_id, reason=a.error)
        return self._release(h.request_id, early=True)

    def lost(self, msg: p.KvLost) -> p.WorkerSubmit | None:
        """KV_LOST: the job (if it still waits) starts now and computes its prompt."""
        job = self._release(f"{msg.job_id}#{msg.attempt}", early=False)
        if job is not None:
            self.counts["kv_lost"] += 1
            log.info("kv_lost", job=msg.job_id)
        return job

    def due(self, now: float) -> list[p.WorkerSubmit]:
        """The jobs whose KV did not come within kv_timeout (to submit now)."""
        late = [rid for rid, (_, deadline) in self.waiting.items() if now >= deadline]
        self.counts["kv_timeouts"] += len(late)
        for rid in late:
            log.warning("kv_timeout", request=rid, seconds=self.kv_timeout)
        return [job for rid in late if (job := self._release(rid, early=False)) is not None]

    def _release(self, rid: str, early: bool) -> p.WorkerSubmit | None:
        entry = self.waiting.pop(rid, None)
        if entry is None:
            if early:
                self._early[rid] = None
                while len(self._early) > _EARLY_KEPT:
                    self._early.popitem(last=False)
            return None
        return dataclasses.replace(entry[0], kv_wait=False)
