"""The client's additions for the gateway: token bytes beside logprobs, and the DONE's queue time."""

from __future__ import annotations

from tokenmill.client.client import Assembly
from tokenmill.protocol import wire as p


def test_token_bytes_and_queue_time_reach_the_events() -> None:
    asm = Assembly("j")
    ev = asm.on_chunk(p.StreamChunk("j", 0, [7], "a", [[[7, -0.5, [97]], [3, -1.5, [0xE2, 0x82]]]]))
    assert ev is not None and ev.logprobs == [{7: -0.5, 3: -1.5}]
    assert ev.token_bytes == [{7: b"a", 3: b"\xe2\x82"}]
    plain = asm.on_chunk(p.StreamChunk("j", 1, [8], "b", [[[8, -0.1]]]))  # a worker that sends no bytes
    assert plain is not None and plain.logprobs == [{8: -0.1}] and plain.token_bytes is None
    done = asm.on_done(p.Done("j", "length", None, (3, 2, 0), 2, queue_time=0.125))
    assert done.queue_time == 0.125 and done.usage is not None and done.usage.completion_tokens == 2
    assert asm.on_done(p.Done("j", "length", None, (3, 2, 0), 2)).queue_time is None
