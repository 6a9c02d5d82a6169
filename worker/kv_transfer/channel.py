"""The KV channel between workers: a decode worker's KVReceiver (a ROUTER, bound) and a prefill worker's
KVSender (a DEALER per decode worker, connected). ZeroMQ delivers a multipart message whole or not at all,
so a sender dying mid-transfer leaves nothing half-written: the receiver simply never gets that message.
Torch-free."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import zmq

from tokenmill.protocol.errors import ProtocolError
from tokenmill.worker.kv_transfer.frames import KVHeader, decode_header

log = structlog.get_logger("tokenmill.kv_transfer")


@dataclass(frozen=True)
class KVArrival:
    """One KV message as received: its header and payload buffer (a ZeroMQ frame's, not copied); once staged
    for the cache (roles.py), `kv` holds the tensor to import, or `error` says why it cannot be."""

    header: KVHeader
    payload: Any
    kv: Any = None
    error: str | None = None


class KVReceiver(threading.Thread):
    """Binds a ROUTER at `bind` ("tcp://127.0.0.1:*": a free port; `address` is where it listens) and hands
    each well-formed KV message to `on_arrival` (from this thread). Malformed messages are logged and
    counted (`dropped`), never raised. An error of the thread itself is kept in `error` for the owner."""

    def __init__(self, ctx: zmq.Context, bind: str, on_arrival: Callable[[KVArrival], None],
                 max_bytes: int) -> None:
        super().__init__(name="tokenmill-kv-receiver", daemon=True)
        self.on_arrival = on_arrival
        self.error: BaseException | None = None
        self.dropped = 0
        self._stopping = threading.Event()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 64)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self.sock.bind(bind)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self.sock.poll(100):
                    self._receive(self.sock.recv_multipart(copy=False))
        except BaseException as e:  # handed to the engine loop, which raises it
            self.error = e
        finally:
            self.sock.close(linger=0)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        try:
            if len(frames) != 4:  # [routing id, MAGIC, header, payload]
                raise ProtocolError(f"a KV message has 3 frames, got {len(frames) - 1}")
            header = decode_header([frames[1].bytes, frames[2].bytes])
        except ProtocolError as e:
            self.dropped += 1
            log.warning("kv_message_dropped", error=str(e)[:200])
            return
        self.on_arrival(KVArrival(header, frames[3].buffer))


class KVSender:
    """DEALERs to the decode workers' KV addresses (one per address, the `keep` most recently used kept open).
    `send` never blocks: False when the message cannot be queued (the peer stopped reading or is gone)."""

    def __init__(self, ctx: zmq.Context, keep: int = 32) -> None:
        self.ctx, self.keep = ctx, keep
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()

    def send(self, address: str, frames: list[Any]) -> bool:
        try:
            sock = self._socket(address)
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as e:  # Again (queue full), or an address that cannot be connected
            log.warning("kv_send_failed", address=address[:200], error=str(e))
            return False

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._socks.pop(address, None)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)  # a clean exit still delivers what is queued
            sock.setsockopt(zmq.SNDHWM, 16)
            try:
                sock.connect(address)
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
        self._socks[address] = sock
        while len(self._socks) > self.keep:
            _, old = self._socks.popitem(last=False)
            old.close()
        return sock

    def close(self) -> None:
        for sock in self._socks.values():
            with contextlib.suppress(zmq.ZMQError):
                sock.close()
        self._socks.clear()
