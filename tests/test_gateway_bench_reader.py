"""The gateway benchmark's lean SSE reader parses a streamed answer however its bytes are split, and fails
(never hangs) on a refused request or a connection that ends early."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenmill.benchmarks.gateway_bench import SSEReader, _Recorder


class _Transport:
    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data


def _event(text: str) -> bytes:
    line = b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"
    return b"%x\r\n" % len(line) + line + b"\r\n"


RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + _event("123") + _event("hello") + _event("456") + _event("") + b"1a\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


@pytest.mark.parametrize("piece", [1, 7, 64, len(RESPONSE)])
def test_reader_records_each_timed_token(piece: int) -> None:
    async def main() -> tuple[_Recorder, SSEReader, _Transport]:
        rec = _Recorder()
        reader, transport = SSEReader(b"REQUEST", rec), _Transport()
        reader.connection_made(transport)  # type: ignore[arg-type]
        for i in range(0, len(RESPONSE), piece):
            reader.data_received(RESPONSE[i:i + piece])
        await asyncio.wait_for(reader.done, 1)
        reader.connection_lost(None)  # after [DONE]: nothing changes
        return rec, reader, transport

    rec, reader, transport = asyncio.run(main())
    assert transport.written == b"REQUEST"
    assert reader.tokens == 2 and rec.steps_ns == [123, 456] and len(rec.latencies_ms) == 2


def test_reader_fails_on_refusal_and_on_early_close() -> None:
    async def main() -> None:
        refused = SSEReader(b"", _Recorder())
        refused.data_received(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n{}")
        with pytest.raises(RuntimeError, match="429"):
            await asyncio.wait_for(refused.done, 1)
        cut = SSEReader(b"", _Recorder())
        cut.data_received(RESPONSE[:120])
        cut.connection_lost(None)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(cut.done, 1)

    asyncio.run(main())
