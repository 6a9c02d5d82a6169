"""The process group of one tensor-parallel worker: one process per rank, rank 0 the worker process itself.

Two groups span the same ranks: the device group (NCCL on CUDA, gloo on the CPU) carries the model's
collectives (an all-reduce after each row-parallel layer and the embedding, the logits' all-gather, the
sampled ids' broadcast); the host group (gloo, CPU tensors) carries rank 0's step inputs to the other ranks
(worker/parallel/step_sync.py), so they never wait on the device to learn what to run. Ranks meet through a
TCPStore that rank 0 opens on 127.0.0.1.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A step's collectives finish in well under this (a rank gone silent for longer is dead).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# The host group waits between steps, for as long as the worker is idle; a dead rank 0 closes its sockets.
IDLE_TIMEOUT = datetime.timedelta(days=365)
HOST = "127.0.0.1"


@dataclass(frozen=True)
class RankSpec:
    """Where one rank sits: its index and the group's size (enough to build its shards)."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")


class TPGroup:
    """The collectives of one rank (`join_group`). A TPGroup without process groups (the default None: the
    default group, uninitialised) only builds shards, e.g. to check a model's shapes before the ranks start."""

    def __init__(self, spec: RankSpec, device: torch.device, device_group: dist.ProcessGroup | None = None,
                 host_group: dist.ProcessGroup | None = None) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.size = spec.size
        self.device = device
        self.device_group = device_group
        self.host_group = host_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C] on each rank -> [N, size * C]: rank r's columns at r * C (the same on every rank)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), in place; returns x."""
        dist.broadcast(x, src=0, group=self.device_group)
        return x

    def host_broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """broadcast() of a CPU tensor over the host group."""
        dist.broadcast(x, src=0, group=self.host_group)
        return x

    def host_min(self, value: int) -> int:
        """The smallest of every rank's `value` (over the host group)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:(k + r) for a base cuda:k (cuda alone: k = 0), the CPU for every rank on the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def open_store(size: int, port: int | None) -> dist.TCPStore:
    """Rank 0 (port None) opens the store on a free port of 127.0.0.1 (its `.port`); the others connect."""
    if port is None:
        return dist.TCPStore(HOST, 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    return dist.TCPStore(HOST, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


def join_group(store: dist.Store, spec: RankSpec, device: torch.device) -> TPGroup:
    """Join the process group (every rank calls this; it returns once all have). One per process: the
    default group of torch.distributed, left with `leave_group`."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group (one engine with "
                           "tensor_parallel_size > 1 per process)")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=spec.rank, world_size=spec.size,
                            timeout=COLLECTIVE_TIMEOUT, device_id=device if cuda else None)
    host_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(spec, device, dist.group.WORLD, host_group)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
