"""The KV message: one ZeroMQ multipart message [MAGIC, header, payload] (a ROUTER prepends the sender's id).

header: msgpack map {job_id, attempt, token_ids, layers, kv_heads, head_dim, block_size, dtype}; `token_ids`
are the tokens whose KV the payload holds (a whole number of blocks, the chain the hashes are made of).
payload: the raw bytes of one C-contiguous tensor [layers, 2 (key, value), blocks, block_size, kv_heads,
head_dim] of `dtype`. Decoding is strict (ProtocolError): nothing is unpickled or evaluated. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from tokenmill.protocol import wire as p
from tokenmill.protocol.errors import ProtocolError

MAGIC = b"TMKV1"
MAX_HEADER_BYTES = 16 << 20
ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class Geometry:
    """The layout of a worker's KV cache; a payload is only accepted by a cache of the same geometry."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # a key of ITEM_SIZES

    def __post_init__(self) -> None:
        if self.dtype not in ITEM_SIZES:
            raise ValueError(f"KV dtype {self.dtype!r} cannot be transferred (one of {sorted(ITEM_SIZES)})")

    def payload_shape(self, blocks: int) -> tuple[int, ...]:
        return (self.layers, 2, blocks, self.block_size, self.kv_heads, self.head_dim)

    def payload_bytes(self, blocks: int) -> int:
        return math.prod(self.payload_shape(blocks)) * ITEM_SIZES[self.dtype]


@dataclass(frozen=True)
class KVHeader:
    job_id: str
    attempt: int
    token_ids: list[int]
    geometry: Geometry

    @property
    def blocks(self) -> int:
        return len(self.token_ids) // self.geometry.block_size

    @property
    def request_id(self) -> str:
        """The engine's id of the job's attempt (worker/process.py)."""
        return f"{self.job_id}#{self.attempt}"


def encode_kv(header: KVHeader, payload: Any) -> list[Any]:
    """The frames of a KV message; `payload` is a buffer of geometry.payload_bytes(blocks) bytes."""
    g = header.geometry
    assert len(header.token_ids) == header.blocks * g.block_size, "the KV covers whole blocks"
    body = {"job_id": header.job_id, "attempt": header.attempt, "token_ids": header.token_ids, "layers": g.layers,
            "kv_heads": g.kv_heads, "head_dim": g.head_dim, "block_size": g.block_size, "dtype": g.dtype}
    return [MAGIC, msgpack.packb(body, use_bin_type=True), payload]


def decode_header(frames: Sequence[bytes]) -> KVHeader:
    """The header of a KV message from its first two frames [MAGIC, header] (the routing id and the payload
    left out), checked; ProtocolError if malformed."""
    if len(frames) != 2 or frames[0] != MAGIC:
        raise ProtocolError("not a KV message (expected [TMKV1, header, payload])")
    d = p.unpack_body(frames[1], MAX_HEADER_BYTES)
    if not isinstance(d, dict) or set(d) != {"job_id", "attempt", "token_ids", "layers", "kv_heads", "head_dim",
                                             "block_size", "dtype"}:
        raise ProtocolError("KV header: wrong keys")
    ints = [d[k] for k in ("attempt", "layers", "kv_heads", "head_dim", "block_size")]
    if not all(type(v) is int and 0 <= v <= p.MAX_TOKEN_ID for v in ints) or min(ints[1:]) < 1:
        raise ProtocolError("KV header: attempt, layers, kv_heads, head_dim, block_size must be integers in range")
    if not (isinstance(d["job_id"], str) and 0 < len(d["job_id"]) <= p.MAX_ID_LEN) or d["dtype"] not in ITEM_SIZES:
        raise ProtocolError("KV header: bad job_id or dtype")
    if not p.valid_token_ids(d["token_ids"]) or len(d["token_ids"]) % d["block_size"]:
        raise ProtocolError("KV header: token_ids must be valid ids, a whole number of blocks")
    g = Geometry(d["layers"], d["kv_heads"], d["head_dim"], d["block_size"], d["dtype"])
    return KVHeader(d["job_id"], d["attempt"], d["token_ids"], g)


def check_payload(header: KVHeader, payload_len: int, mine: Geometry) -> str | None:
    """Why this KV cannot go into a cache of geometry `mine` (or its payload is not what the header says),
    or None."""
    if header.geometry != mine:
        return f"KV geometry {header.geometry} differs from this worker's {mine}"
    if payload_len != mine.payload_bytes(header.blocks):
        return f"KV payload of {payload_len} bytes; {header.blocks} blocks need {mine.payload_bytes(header.blocks)}"
    return None
