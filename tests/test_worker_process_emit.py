"""The engine loop's per-step output (worker/process.py EngineLoop._emit), in-process: one TOKENS message
(the [attempts, entries] body, as p.encode(p.Tokens(...)) makes it) then FINISHED and ERROR, on the data
socket, or handed over to the IO thread (the loop then waits for its `forwarded` event, when configured)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.protocol import wire as p
from tokenmill.worker.outputs import RequestOutput, Usage
from tokenmill.worker.process import EngineLoop, WorkerOptions


class Recorder:
    """Stands in for the outbox socket and the IO thread's `forwarded` event; records the call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.calls.append(("send", p.decode(frames, p.WORKER_TO_BROKER)))
        assert frames == p.encode(self.calls[-1][1])  # exactly the protocol's one encoding

    def clear(self) -> None:
        self.calls.append(("clear", None))

    def wait(self, timeout: float) -> bool:
        self.calls.append(("wait", timeout))
        return True


class DataRecorder:
    """Stands in for the engine loop's data socket."""

    def __init__(self) -> None:
        self.sent: list[p.Message] = []
        self.linger: int | None = None

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(p.decode(frames, p.WORKER_TO_BROKER))

    def close(self, linger: int) -> None:
        self.linger = linger


class FakeIO:
    def __init__(self, rec: Recorder) -> None:
        self.forwarded = rec


class FakeTokenizer:
    token_bytes = tuple(bytes([65 + i]) for i in range(16))  # id i is the letter chr(65 + i)


class FakeEngine:
    tokenizer = FakeTokenizer()


def _loop(wait: float) -> tuple[EngineLoop, Recorder]:
    rec = Recorder()
    loop = EngineLoop(FakeEngine(), FakeIO(rec), rec, WorkerOptions(handoff_wait=wait), p.Ready(  # type: ignore[arg-type]
        "w", ["m"], 1, 1, 16, 64, 1.0))
    loop.active = {"a#0": ("a", 0), "b#2": ("b", 2), "c#0": ("c", 0), "d#1": ("d", 1)}
    return loop, rec


OUTPUTS = [
    RequestOutput("a#0", [5, 6], "xy", 3),
    RequestOutput("b#2", [], "held", 7),  # text only (e.g. a stop string's cut)
    RequestOutput("gone#0", [1], "z", 0),  # not active (aborted): dropped
    RequestOutput("c#0", [9], "q", 0, logprobs=[{9: -0.25, 4: -2.0}]),
    RequestOutput("d#1", [8], "e", 4, finished=True, finish_reason="length", usage=Usage(2, 5, 1)),
    RequestOutput("a#0", [], "", 5, finished=True, finish_reason="error", error="boom"),
]


@pytest.mark.parametrize("wait", [0.0, 0.002])
def test_one_tokens_message_then_finished_and_errors(wait: float) -> None:
    loop, rec = _loop(wait)
    loop._emit(OUTPUTS)
    sends = [m for kind, m in rec.calls if kind == "send"]
    assert sends == [
        p.Tokens([p.TokenChunk("a", 0, 3, [5, 6], "xy"), p.TokenChunk("b", 2, 7, [], "held"),
                  p.TokenChunk("c", 0, 0, [9], "q", [[[9, -0.25, [74]], [4, -2.0, [69]]]]),
                  p.TokenChunk("d", 1, 4, [8], "e")]),
        p.Finished([p.FinishedJob("d", 1, "length", None, (2, 5, 1))]),
        p.JobError("a", 0, "failed", "boom"),
    ]
    assert loop.active == {"b#2": ("b", 2), "c#0": ("c", 0)}
    kinds = [kind for kind, _ in rec.calls]
    if wait:  # cleared before the first push, waited on after the last
        assert kinds == ["clear", "send", "send", "send", "wait"] and rec.calls[-1] == ("wait", wait)
    else:
        assert kinds == ["send", "send", "send"]


def test_with_a_data_socket_the_loop_sends_there_and_does_not_wait() -> None:
    loop, outbox = _loop(0.002)
    data = DataRecorder()
    loop.data = data  # type: ignore[assignment]
    loop._emit(OUTPUTS)
    assert outbox.calls == []
    assert [type(m) for m in data.sent] == [p.Tokens, p.Finished, p.JobError]
    assert loop.close(goodbye=True) and loop.data is None
    assert type(data.sent[-1]) is p.WorkerDisconnect and data.linger == 500  # behind the output


def test_a_step_with_nothing_to_send_neither_pushes_nor_waits() -> None:
    loop, rec = _loop(0.002)
    loop._emit([RequestOutput("gone#0", [1], "z", 0), RequestOutput("a#0", [], "", 3)])
    assert rec.calls == []
