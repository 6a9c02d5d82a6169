"""The engine loop's per-step output (worker/process.py EngineLoop._emit), in-process: one TOKENS message
(the [attempts, entries] body, as p.encode(p.Tokens(...)) makes it) then FINISHED and ERROR, on the data
socket (never through the IO thread)."""

from __future__ import annotations

from tokenmill.protocol import wire as p
from tokenmill.worker.outputs import RequestOutput, RequestTimeline, Usage
from tokenmill.worker.process import EngineLoop, WorkerOptions


class DataRecorder:
    """Stands in for the engine loop's data socket."""

    def __init__(self) -> None:
        self.sent: list[p.Message] = []
        self.linger: int | None = None

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(p.decode(frames, p.WORKER_TO_BROKER))
        assert frames == p.encode(self.sent[-1])  # exactly the protocol's one encoding

    def close(self, linger: int) -> None:
        self.linger = linger


class Outbox:
    """Stands in for the inproc PUSH socket to the IO thread, which only READY may use."""

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        raise AssertionError("output went to the IO thread")


class FakeTokenizer:
    token_bytes = tuple(bytes([65 + i]) for i in range(16))  # id i is the letter chr(65 + i)


class FakeEngine:
    tokenizer = FakeTokenizer()


def _loop() -> tuple[EngineLoop, DataRecorder]:
    loop = EngineLoop(FakeEngine(), None, Outbox(), WorkerOptions(), p.Ready(  # type: ignore[arg-type]
        "w", ["m"], 1, 1, 16, 64, 1.0), None)  # type: ignore[arg-type]
    data = DataRecorder()
    loop.data = data  # type: ignore[assignment]
    loop.active = {"a#0": ("a", 0), "b#2": ("b", 2), "c#0": ("c", 0), "d#1": ("d", 1)}
    return loop, data


OUTPUTS = [
    RequestOutput("a#0", [5, 6], "xy", 3),
    RequestOutput("b#2", [], "held", 7),  # text only (e.g. a stop string's cut)
    RequestOutput("gone#0", [1], "z", 0),  # not active (aborted): dropped
    RequestOutput("c#0", [9], "q", 0, logprobs=[{9: -0.25, 4: -2.0}]),
    RequestOutput("d#1", [8], "e", 4, finished=True, finish_reason="length", usage=Usage(2, 5, 1)),
    RequestOutput("a#0", [], "", 5, finished=True, finish_reason="error", error="boom"),
]


def test_one_tokens_message_then_finished_and_errors_on_the_data_socket() -> None:
    loop, data = _loop()
    loop._emit(OUTPUTS)
    assert data.sent == [
        p.Tokens([p.TokenChunk("a", 0, 3, [5, 6], "xy"), p.TokenChunk("b", 2, 7, [], "held"),
                  p.TokenChunk("c", 0, 0, [9], "q", [[[9, -0.25, [74]], [4, -2.0, [69]]]]),
                  p.TokenChunk("d", 1, 4, [8], "e")]),
        p.Finished([p.FinishedJob("d", 1, "length", None, (2, 5, 1))]),
        p.JobError("a", 0, "failed", "boom"),
    ]
    assert loop.active == {"b#2": ("b", 2), "c#0": ("c", 0)}


def test_a_finished_job_carries_its_timeline_since_the_worker_received_it() -> None:
    loop, data = _loop()
    loop.received = {"d#1": 100.0, "c#0": 50.0}
    done = RequestOutput("d#1", [8], "e", 4, finished=True, finish_reason="length", usage=Usage(2, 5, 1),
                         timeline=RequestTimeline(100.25, 100.5, 101.0))
    loop._emit([done])
    assert data.sent[-1] == p.Finished([p.FinishedJob("d", 1, "length", None, (2, 5, 1),
                                                      p.WorkerTimeline(0.25, 0.5, 1.0))])
    assert loop.received == {"c#0": 50.0}  # the finished one's entry is dropped, the others stay


def test_goodbye_goes_behind_the_output_on_the_data_socket() -> None:
    loop, data = _loop()
    loop._emit(OUTPUTS)
    assert loop.close(goodbye=True) and loop.data is None
    assert [type(m) for m in data.sent] == [p.Tokens, p.Finished, p.JobError, p.WorkerDisconnect]
    assert data.linger == 500  # lets the output and DISCONNECT go out


def test_a_step_with_nothing_to_send_sends_nothing() -> None:
    loop, data = _loop()
    loop._emit([RequestOutput("gone#0", [1], "z", 0), RequestOutput("a#0", [], "", 3)])
    assert data.sent == []
