"""Acceptance item 7: Hypothesis-fuzzed frames (bad msgpack, wrong types, huge lengths, deep nesting,
wrong frame counts, oversized bodies) at both broker sockets. Each malformed message is rejected and
counted (clients also get a FAIL "protocol" answer); the broker keeps serving a real worker throughout."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from helpers_net import addr, free_port, procs_ctx, wait_workers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.client import Client
from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import ProtocolError

pytestmark = pytest.mark.timeout(300)

CMDS = [int(c) for c in p.Cmd] + [0, 0x7F, 0xFF]
HUGE = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
        b"\xdc\xff\xff", b"\xda\xff\xff"]

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=5),
    max_leaves=25,
)


def _nest(depth: int) -> Any:
    v: Any = []
    for _ in range(depth):
        v = [v]
    return v


def _msg(cmd: int, body: bytes) -> list[bytes]:
    return [p.HEADER, bytes((cmd,)), body]


FRAMES = st.one_of(
    st.lists(st.binary(max_size=40), min_size=1, max_size=5),  # wrong frame counts, junk headers
    st.tuples(st.sampled_from(CMDS), st.binary(max_size=200)).map(lambda t: _msg(*t)),  # bad msgpack
    st.tuples(st.sampled_from(CMDS), _json).map(lambda t: _msg(t[0], msgpack.packb(t[1]))),  # wrong types
    st.tuples(st.sampled_from(CMDS), st.sampled_from(HUGE)).map(lambda t: _msg(*t)),  # huge lengths
    st.tuples(st.sampled_from(CMDS), st.integers(17, 3000))  # deep nesting
    .map(lambda t: _msg(t[0], msgpack.packb(_nest(t[1])) if t[1] < 1000 else b"\x91" * t[1] + b"\xc0")),
    st.integers(17, 60).map(lambda d: _msg(p.Cmd.SUBMIT, msgpack.packb(  # deep params inside a valid shape
        {"job_id": "j", "model": "", "prompt": "x", "params": {"extra": _nest(d)}}))),
    st.tuples(st.sampled_from(CMDS), st.binary(min_size=1, max_size=8))  # a wrong header
    .map(lambda t: [b"TM9", bytes((t[0],)), t[1]]),
)


def _rejected(frames: list[bytes], allowed: frozenset[p.Cmd]) -> bool:
    try:
        p.decode(frames, allowed)
    except ProtocolError:
        return True
    return False


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path_factory.mktemp("fuzz")) as ps:
        ps.broker(front, back)
        ps.worker(back, name="w0")
        with Client(addr(front)) as c:
            wait_workers(c, 1)
        yield front, back


def _dealer(ctx: zmq.Context, port: int) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr(port))
    return s


def _counters(front: int) -> dict[str, int]:
    with Client(addr(front)) as c:
        return dict(c.stats()["counters"])


def _still_serves(front: int) -> None:
    with Client(addr(front)) as c:
        assert len(c.generate("still alive", max_tokens=3, ignore_eos=True, timeout=30).token_ids) == 3


def test_fuzzed_frames_at_client_socket(broker: tuple[int, int]) -> None:
    front, _ = broker
    before = _counters(front)
    ctx = zmq.Context()
    sock = _dealer(ctx, front)
    sent_bad = [0]

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames=FRAMES)
    def check(frames: list[bytes]) -> None:
        sock.send_multipart(frames)
        if not _rejected(frames, p.CLIENT_TO_BROKER):
            return
        sent_bad[0] += 1
        # The answer to a malformed message is one FAIL "protocol" (other replies may precede it).
        while True:
            assert sock.poll(5000), "no answer to a malformed message"
            reply = p.decode(sock.recv_multipart(), p.BROKER_TO_CLIENT)
            if isinstance(reply, p.Fail) and reply.code == "protocol":
                return

    try:
        check()
    finally:
        sock.close()
        ctx.term()
    after = _counters(front)
    rejected = after.get("malformed_client_messages", 0) - before.get("malformed_client_messages", 0)
    assert rejected == sent_bad[0] > 50
    _still_serves(front)


def test_fuzzed_frames_at_worker_socket(broker: tuple[int, int]) -> None:
    front, back = broker
    before = _counters(front)
    ctx = zmq.Context()
    sock = _dealer(ctx, back)
    sent_bad = [0]

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames=FRAMES)
    def check(frames: list[bytes]) -> None:
        if frames[:2] == [p.HEADER, bytes((p.Cmd.W_READY,))] and not _rejected(frames, p.WORKER_TO_BROKER):
            return  # a valid READY would register a fake worker; not what this test is about
        sock.send_multipart(frames)
        sent_bad[0] += _rejected(frames, p.WORKER_TO_BROKER)

    try:
        check()
        _still_serves(front)  # also proves everything sent before was processed
    finally:
        sock.close()
        ctx.term()
    after = _counters(front)
    rejected = after.get("malformed_worker_messages", 0) - before.get("malformed_worker_messages", 0)
    assert rejected == sent_bad[0] > 50


def test_oversized_frames(broker: tuple[int, int], tmp_path: Path) -> None:
    front, back = broker
    ctx = zmq.Context()
    try:
        client = _dealer(ctx, front)
        # Over the decoder's limit but under MAXMSGSIZE: dropped, counted, answered.
        client.send_multipart(_msg(p.Cmd.SUBMIT, b"\x00" * (p.MAX_BODY_BYTES + 1)))
        assert client.poll(10_000)
        reply = p.decode(client.recv_multipart(), p.BROKER_TO_CLIENT)
        assert isinstance(reply, p.Fail) and reply.code == "protocol"
        # Over MAXMSGSIZE: libzmq cuts that peer off; the broker is unaffected.
        worker = _dealer(ctx, back)
        worker.send_multipart(_msg(p.Cmd.W_TOKENS, b"\x00" * (2 * p.MAX_BODY_BYTES + 16)))
        client.close()
        worker.close()
    finally:
        ctx.term()
    assert _counters(front).get("oversized_frames", 0) >= 1
    _still_serves(front)
