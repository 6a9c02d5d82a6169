"""Wire protocol: round trips of every message, strict rejection of malformed input, limits."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import ProtocolError

SAMPLES: list[p.Message] = [
    p.Submit("job-1", "tiny-llama", p.RequestInput(prompt="hello"), {"max_tokens": 4, "temperature": 0.0},
             timeout=3.5, priority=2, owner="me", from_seq=0),
    p.Submit("job-2", "", p.RequestInput(messages=[{"role": "user", "content": "hi"}]), {"stop": ["\n"]}),
    p.Submit("job-3", "m", p.RequestInput(prompt_token_ids=[1, 2, 3]), {}, cancel_on_disconnect=False),
    p.Cancel("job-1", "me"),
    p.Subscribe("job-1", "me", 7),
    p.Ping(), p.Bye(), p.StatsRequest(),
    p.Ack("job-1", duplicate=True),
    p.Stream([p.StreamChunk("job-1", 0, [5, 6], "ab", None),
              p.StreamChunk("job-2", 3, [7], "c", [[[7, -0.5], [8, -1.0]]])]),
    p.Stream([p.StreamChunk("job-3", 0, [7], "c", [[[7, -0.5, [99]], [8, -1.0, [0xE2, 0x82]]]])]),
    p.Done("job-1", "length", None, (3, 4, 0), 4),
    p.Done("job-1", "stop", "\n", (3, 4, 0), 4),
    p.Done("job-1", "stop", None, (3, 4, 0), 4, queue_time=0.25),
    p.Done("job-1", "stop", None, (3, 4, 0), 4, 0.25, p.WorkerTimeline(0.001, 0.002, 0.03)),
    p.Fail("job-1", "overloaded", "queue full", 0.5),
    p.Pong(),
    p.StatsReply({"counters": {"dispatches": 3}, "workers": [{"name": "w"}]}),
    p.Ready("w-1", ["tiny-llama", "llama"], 128, 1000, 16, 2048, 0.2),
    p.Ready("w-1", ["tiny-llama"], 128, 1000, 16, 2048, 0.2, data_id="w-1-ab12/data"),
    p.Ready("w-d", ["tiny-llama"], 8, 100, 16, 2048, 0.2, role="decode", kv_address="tcp://127.0.0.1:7001"),
    p.Ready("w-g", ["llama"], 8, 100, 16, 2048, 0.2, sampling_defaults={"temperature": 0.6, "top_k": 20}),
    p.Prefilled("job-1", 0, 12),
    p.KvLost("job-1", 0),
    p.WorkerHeartbeat(1, 2, 3, 4),
    p.WorkerHeartbeat(1, 2, 3, 4, steps=100, prefix_queries=7, prefix_hits=5, preemptions=1),
    p.Tokens([p.TokenChunk("job-1", 1, 4, [9, 10], "xy", None)]),
    p.Finished([p.FinishedJob("job-1", 1, "stop", 2, (3, 6, 0))]),
    p.Finished([p.FinishedJob("job-1", 1, "stop", 2, (3, 6, 0), p.WorkerTimeline(0.0, 0.5, 1.25))]),
    p.JobError("job-1", 0, "invalid", "max_tokens must be >= 1"),
    p.WorkerDisconnect(),
    p.WorkerSubmit("job-1", 2, p.RequestInput(prompt="hello"), {"max_tokens": 8}, [5, 6], 0),
    p.WorkerSubmit("job-1", 0, p.RequestInput(prompt="hi"), {}, [], 0, kv_send="tcp://127.0.0.1:7001"),
    p.WorkerSubmit("job-1", 0, p.RequestInput(prompt="hi"), {}, [], 0, kv_wait=True),
    p.WorkerCancel("job-1", 2),
    p.BrokerHeartbeat(),
    p.BrokerDisconnect("reregister"),
]


def test_a_finished_job_without_a_timeline_slot_still_decodes() -> None:
    body = msgpack.packb([["a", 0, "stop", None, [1, 1, 0]]])
    msg = p.decode([p.HEADER, bytes((p.Cmd.W_FINISHED,)), body])
    assert msg == p.Finished([p.FinishedJob("a", 0, "stop", None, (1, 1, 0))])


def test_tokens_body_is_attempts_and_stream_entries() -> None:
    chunks = [p.TokenChunk("job-1", 1, 4, [9, 10], "xy"), p.TokenChunk("job-2", 0, 0, [3], "z", [[[3, -0.5]]])]
    frames = p.encode(p.Tokens(chunks))
    assert p.encode_tokens([1, 0], [c.entry() for c in chunks]) == frames
    attempts, entries, offset = p.split_tokens_body(frames[2])
    assert attempts == [1, 0] and entries == [c.entry() for c in chunks]
    # the entries' bytes are what a client decodes as a STREAM body
    stream = p.decode([p.HEADER, bytes((p.Cmd.STREAM,)), frames[2][offset:]], p.BROKER_TO_CLIENT)
    assert isinstance(stream, p.Stream)
    assert stream.chunks == [p.StreamChunk(c.job_id, c.seq, c.token_ids, c.text, c.logprobs) for c in chunks]


def test_heartbeat_of_four_items_has_zero_counters_and_other_lengths_fail() -> None:
    body = msgpack.packb([1, 2, 3, 4])
    hb = p.decode([p.HEADER, bytes((p.Cmd.W_HEARTBEAT,)), body], p.WORKER_TO_BROKER)
    assert hb == p.WorkerHeartbeat(1, 2, 3, 4, 0, 0, 0, 0)
    for bad in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, -1, 0, 0, 0]):
        with pytest.raises(ProtocolError):
            p.decode([p.HEADER, bytes((p.Cmd.W_HEARTBEAT,)), msgpack.packb(bad)], p.WORKER_TO_BROKER)


@pytest.mark.parametrize("entry", [[7, -0.5, [256]], [7, -0.5, "ab"], [7, -0.5, [1] * 257], [7, -0.5, [1], 0]])
def test_logprob_token_bytes_must_be_a_short_list_of_byte_values(entry: list[Any]) -> None:
    body = msgpack.packb([["job", 0, [7], "c", [[entry]]]])
    with pytest.raises(ProtocolError):
        p.decode([p.HEADER, bytes((p.Cmd.STREAM,)), body], p.BROKER_TO_CLIENT)


def test_every_command_has_a_sample() -> None:
    assert {m.CMD for m in SAMPLES} == set(p.Cmd)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: p.Message) -> None:
    frames = p.encode(msg)
    assert frames[0] == p.HEADER and len(frames) == 3
    assert p.decode(frames) == msg


def test_direction_sets_partition_commands() -> None:
    sets = [p.CLIENT_TO_BROKER, p.BROKER_TO_CLIENT, p.WORKER_TO_BROKER, p.BROKER_TO_WORKER]
    assert sum(len(s) for s in sets) == len(p.Cmd)
    assert frozenset().union(*sets) == frozenset(p.Cmd)


def test_command_not_allowed_in_direction() -> None:
    with pytest.raises(ProtocolError, match="not allowed"):
        p.decode(p.encode(p.Ready("w", ["m"], 1, 1, 16, 64, 0.2)), p.CLIENT_TO_BROKER)


def _nest(depth: int) -> Any:
    v: Any = {}
    for _ in range(depth):
        v = {"k": v}
    return v


def _frames(cmd: p.Cmd, body: Any) -> list[bytes]:
    return [p.HEADER, bytes((cmd,)), msgpack.packb(body)]


BAD: list[tuple[str, list[bytes]]] = [
    ("two frames", [p.HEADER, b"\x01"]),
    ("bad header", [b"XX1", b"\x04", msgpack.packb({})]),
    ("long command", [p.HEADER, b"\x04\x04", msgpack.packb({})]),
    ("unknown command", [p.HEADER, b"\x7f", msgpack.packb({})]),
    ("bad msgpack", [p.HEADER, b"\x04", b"\xc1"]),
    ("trailing bytes", [p.HEADER, b"\x04", msgpack.packb({}) + b"\x00"]),
    ("truncated", [p.HEADER, b"\x01", msgpack.packb({"job_id": "x" * 40})[:-3]]),
    ("ext type", [p.HEADER, b"\x04", msgpack.packb(msgpack.ExtType(1, b"x"))]),
    ("bin", [p.HEADER, b"\x01", msgpack.packb({"job_id": b"x"}, use_bin_type=True)]),
    ("int map key", [p.HEADER, b"\x04", msgpack.packb({1: 2})]),
    ("ping with keys", _frames(p.Cmd.PING, {"x": 1})),
    ("submit no input", _frames(p.Cmd.SUBMIT, {"job_id": "a", "model": "", "params": {}})),
    ("submit two inputs", _frames(p.Cmd.SUBMIT, {"job_id": "a", "model": "", "params": {}, "prompt": "x",
                                                 "prompt_token_ids": [1]})),
    ("submit bool timeout", _frames(p.Cmd.SUBMIT, {"job_id": "a", "model": "", "params": {}, "prompt": "x",
                                                   "timeout": True})),
    ("submit nan timeout", _frames(p.Cmd.SUBMIT, {"job_id": "a", "model": "", "params": {}, "prompt": "x",
                                                  "timeout": float("nan")})),
    ("submit empty id", _frames(p.Cmd.SUBMIT, {"job_id": "", "model": "", "params": {}, "prompt": "x"})),
    ("submit long id", _frames(p.Cmd.SUBMIT, {"job_id": "a" * 500, "model": "", "params": {}, "prompt": "x"})),
    ("submit unknown key", _frames(p.Cmd.SUBMIT, {"job_id": "a", "model": "", "params": {}, "prompt": "x",
                                                  "evil": 1})),
    ("params deep", _frames(p.Cmd.SUBMIT, {"job_id": "a", "model": "", "prompt": "x",
                                           "params": {"extra": _nest(20)}})),
    ("params list of maps", _frames(p.Cmd.SUBMIT, {"job_id": "a", "model": "", "prompt": "x",
                                                   "params": {"stop": [{}]}})),
    ("messages bad role", _frames(p.Cmd.SUBMIT, {"job_id": "a", "model": "", "params": {},
                                                 "messages": [{"role": 1, "content": "x"}]})),
    ("unknown role", _frames(p.Cmd.W_READY, {"name": "w", "models": ["m"], "capacity": 1, "kv_blocks": 1,
                                             "block_size": 16, "max_model_len": 64, "heartbeat_interval": 1.0,
                                             "role": "boss"})),
    ("prefilled negative", _frames(p.Cmd.W_PREFILLED, ["a", 0, -1])),
    ("negative token", _frames(p.Cmd.W_TOKENS, [[0], [["a", 0, [-1], "", None]]])),
    ("huge token", _frames(p.Cmd.W_TOKENS, [[0], [["a", 0, [1 << 40], "", None]]])),
    ("bool token", _frames(p.Cmd.W_TOKENS, [[0], [["a", 0, [True], "", None]]])),
    ("short chunk", _frames(p.Cmd.W_TOKENS, [[0], [["a", 0, [1], ""]]])),
    ("logprob count", _frames(p.Cmd.W_TOKENS, [[0], [["a", 0, [1], "", []]]])),
    ("bool attempt", _frames(p.Cmd.W_TOKENS, [[True], [["a", 0, [1], "", None]]])),
    ("attempt count", _frames(p.Cmd.W_TOKENS, [[0, 0], [["a", 0, [1], "", None]]])),
    ("old tokens shape", _frames(p.Cmd.W_TOKENS, [["a", 0, 0, [1], "", None]])),
    ("tokens extra column", _frames(p.Cmd.W_TOKENS, [[0], [["a", 0, [1], "", None]], []])),
    ("bad finish", _frames(p.Cmd.W_FINISHED, [["a", 0, "exploded", None, [1, 1, 0], None]])),
    ("finished job of four", _frames(p.Cmd.W_FINISHED, [["a", 0, "stop", None]])),
    ("negative timeline", _frames(p.Cmd.W_FINISHED, [["a", 0, "stop", None, [1, 1, 0], [0.1, -1.0, 0.2]]])),
    ("short timeline", _frames(p.Cmd.W_FINISHED, [["a", 0, "stop", None, [1, 1, 0], [0.1, 0.2]]])),
    ("nan timeline", _frames(p.Cmd.W_FINISHED, [["a", 0, "stop", None, [1, 1, 0], [0.1, float("nan"), 0.2]]])),
    ("text timeline", _frames(p.Cmd.DONE, {"job_id": "a", "finish_reason": "stop", "stop_reason": None,
                                           "usage": [1, 1, 0], "num_tokens": 1, "worker_timeline": "soon"})),
    ("unknown default", _frames(p.Cmd.W_READY, {"name": "w", "models": ["m"], "capacity": 1, "kv_blocks": 1,
                                                "block_size": 16, "max_model_len": 8, "heartbeat_interval": 1,
                                                "sampling_defaults": {"seed": 3}})),
    ("default out of range", _frames(p.Cmd.W_READY, {"name": "w", "models": ["m"], "capacity": 1, "kv_blocks": 1,
                                                     "block_size": 16, "max_model_len": 8, "heartbeat_interval": 1,
                                                     "sampling_defaults": {"top_p": 2.0}})),
    ("float top_k default", _frames(p.Cmd.W_READY, {"name": "w", "models": ["m"], "capacity": 1, "kv_blocks": 1,
                                                    "block_size": 16, "max_model_len": 8, "heartbeat_interval": 1,
                                                    "sampling_defaults": {"top_k": 2.5}})),
    ("zero capacity", _frames(p.Cmd.W_READY, {"name": "w", "models": ["m"], "capacity": 0, "kv_blocks": 1,
                                              "block_size": 16, "max_model_len": 8, "heartbeat_interval": 1})),
    ("stats deep", _frames(p.Cmd.STATS_REPLY, _nest(40))),
    ("fail unknown code", _frames(p.Cmd.FAIL, {"job_id": "a", "code": "oops"})),
]


@pytest.mark.parametrize(("name", "frames"), BAD, ids=[b[0] for b in BAD])
def test_malformed_is_rejected(name: str, frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        p.decode(frames)


def test_size_limit() -> None:
    big = p.encode(p.Submit("a", "", p.RequestInput(prompt="x" * 2000), {}))
    with pytest.raises(ProtocolError, match="exceeds"):
        p.decode(big, max_bytes=1000)
    assert isinstance(p.decode(big), p.Submit)


def test_huge_declared_lengths_are_refused_cheaply() -> None:
    # An array header claiming 2**32-1 items followed by nothing: refused by the limit, not allocated.
    for body in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError):
            p.decode([p.HEADER, b"\x01", body])


def test_deep_nesting_in_body() -> None:
    with pytest.raises(ProtocolError):
        p.decode([p.HEADER, b"\x01", b"\x91" * 100_000 + b"\xc0"])


@settings(max_examples=300, deadline=None)
@given(cmd=st.sampled_from(list(p.Cmd)), body=st.binary(max_size=200))
def test_fuzz_random_bytes_only_raise_protocol_error(cmd: p.Cmd, body: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        p.decode([p.HEADER, bytes((cmd,)), body])


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70).filter(lambda x: -(2**63) <= x < 2**64)
    | st.floats() | st.text(max_size=10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(cmd=st.sampled_from(list(p.Cmd)), obj=_json)
def test_fuzz_wrong_types_only_raise_protocol_error(cmd: p.Cmd, obj: Any) -> None:
    with contextlib.suppress(ProtocolError):
        p.decode([p.HEADER, bytes((cmd,)), msgpack.packb(obj)])


@settings(max_examples=200, deadline=None)
@given(msg=st.sampled_from(SAMPLES), data=st.data())
def test_fuzz_mutated_valid_messages(msg: p.Message, data: st.DataObject) -> None:
    """Flip bytes of valid encodings: decode either succeeds with a message of the same command or
    raises ProtocolError, never anything else."""
    frames = p.encode(msg)
    body = bytearray(frames[2])
    for _ in range(data.draw(st.integers(1, 4))):
        if body:
            i = data.draw(st.integers(0, len(body) - 1))
            body[i] = data.draw(st.integers(0, 255))
    try:
        out = p.decode([frames[0], frames[1], bytes(body)])
    except ProtocolError:
        return
    assert out.CMD == msg.CMD
