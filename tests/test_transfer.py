"""worker/transfer.py: `ship` of numpy arrays and CPU tensors, and the reused pinned buffers (StagingRing,
OutputBuffers): a buffer is never written while a queued copy or an unread output still needs it. On the CPU
the fences are fakes that say when the "copy" has run; the CUDA tests queue real copies behind a sleeping
kernel, so that a buffer reused too early would hand the wrong values to the first copy."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from test_async_scheduling import make_engine, prompts, results, run
from tiny_hf import save_tiny_model

from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.transfer import HostCopy, OutputBuffers, StagingRing, as_tensors, ship

CPU = torch.device("cpu")


class FakeFence:
    """A copy's fence: `done` says whether the device has passed it; synchronize() waits (here: completes)."""

    made: ClassVar[list[FakeFence]] = []

    def __init__(self) -> None:
        self.done = True
        self.records = 0
        self.syncs = 0
        FakeFence.made.append(self)

    def record(self) -> None:
        self.records += 1
        self.done = False  # a copy is queued behind it

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True


def test_ship_of_numpy_arrays_and_tensors_keeps_names_dtypes_shapes_values_and_alignment() -> None:
    """Every part starts on the 16-byte grid: Triton specializes a kernel on its pointers' divisibility by 16,
    and the warm-up compiles the aligned variants."""
    host: dict[str, np.ndarray | torch.Tensor] = {
            "i64": np.arange(7, dtype=np.int64), "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
            "t64": torch.arange(3, dtype=torch.int64), "f32": np.array([[1.5, -2.0]], dtype=np.float32).T,
            "none": np.zeros((4, 0), dtype=np.int64), "b": np.array([True, False]),
            "bf16": torch.tensor([1.25, -3.5], dtype=torch.bfloat16), "one": np.array([9], dtype=np.int32)}
    dev = ship(host, CPU)
    assert dev.keys() == host.keys()
    for name, a in host.items():
        want = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
        assert dev[name].dtype == want.dtype and dev[name].shape == want.shape and torch.equal(dev[name], want), name
    assert all(t.data_ptr() % 16 == 0 for t in dev.values() if t.numel()), "a part off the 16-byte grid"
    dev["i64"][0] = 100  # parts are distinct memory: writing one leaves its neighbours alone
    assert dev["t64"].tolist() == [0, 1, 2] and dev["i32"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert as_tensors(host, ("i64", "missing", "t64"))["i64"].tolist() == list(range(7))


def test_staging_ring_waits_for_the_copy_that_last_read_a_buffer() -> None:
    FakeFence.made.clear()
    ring = StagingRing(slots=2, pin=False, fence=FakeFence)
    s0, b0 = ring.take(100)
    ring.copied(s0)  # its copy is queued, not run
    s1, b1 = ring.take(100)
    ring.copied(s1)
    assert s0 != s1 and b0.data_ptr() != b1.data_ptr(), "a buffer whose copy is queued was handed out again"
    f0, f1 = FakeFence.made
    s2, b2 = ring.take(100)  # slot 0 again: only once its copy has run
    assert s2 == s0 and b2.data_ptr() == b0.data_ptr() and f0.syncs == 1 and f1.syncs == 0
    ring.copied(s2)
    f1.done = True  # slot 1's copy ran meanwhile: no wait for it
    s3, b3 = ring.take(10_000)  # grows
    assert s3 == s1 and f1.syncs == 0 and b3.numel() >= 10_000


def test_output_buffers_come_back_only_after_their_values_were_read() -> None:
    FakeFence.made.clear()
    buffers = OutputBuffers(pin=False, fence=FakeFence)
    a = HostCopy([torch.arange(5), torch.full((2, 3), 0.5)], buffers)
    b = HostCopy([torch.arange(10, 13), torch.full((1, 3), -1.0)], buffers)  # a is unread: b gets other buffers
    assert buffers.slots_made == 2
    assert b.tolist() == [[10, 11, 12], [[-1.0, -1.0, -1.0]]]
    assert a.tolist() == [[0, 1, 2, 3, 4], [[0.5] * 3] * 2]
    assert all(f.syncs == 1 for f in FakeFence.made), "values read before the copy's fence was waited on"
    c = HostCopy([torch.arange(40, 48), torch.zeros((3, 3))], buffers)  # reuses (and grows) a read set
    assert buffers.slots_made == 2 and c.tolist() == [list(range(40, 48)), [[0.0] * 3] * 3]
    assert a.tolist() == [[0, 1, 2, 3, 4], [[0.5] * 3] * 2] and b.tolist()[0] == [10, 11, 12]  # kept lists
    held = HostCopy([torch.arange(3)], buffers).wait()  # handed-out tensors: their buffers never come back
    HostCopy([torch.arange(7, 10)], buffers).tolist()
    assert held[0].tolist() == [0, 1, 2]


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))


def test_async_engine_with_reused_output_buffers_matches_sync(hf_path: Path) -> None:
    """Async scheduling reads step N's outputs after step N+1 was launched: with the runner's outputs copied
    through reused buffers (as on CUDA), every token and logprob stays that of the synchronous engine."""
    jobs = [(f"r{i}", p, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12, ignore_eos=True,
                                        logprobs=2 if i % 3 == 0 else None))
            for i, p in enumerate(prompts(384, 6, seed=3))]
    want = results(run(make_engine(str(hf_path), False), jobs))
    engine = make_engine(str(hf_path), True)
    engine.runner.output_buffers = buffers = OutputBuffers(pin=False, fence=FakeFence)
    assert results(run(engine, jobs)) == want
    assert 2 <= buffers.slots_made <= 3, "two steps in flight need two sets of buffers, and no more are made"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_ship_through_one_staging_buffer_waits_for_the_queued_copy() -> None:
    cuda = torch.device("cuda")
    ring = StagingRing(slots=1)  # every ship reuses the same pinned buffer
    torch.cuda._sleep(200_000_000)  # the copies below queue behind ~0.1 s of GPU time
    first = ship({"x": np.arange(4096, dtype=np.int64)}, cuda, ring)
    second = ship({"x": np.arange(4096, dtype=np.int64) + 7}, cuda, ring)
    assert torch.equal(first["x"].cpu(), torch.arange(4096)) and torch.equal(second["x"].cpu(), torch.arange(4096) + 7)


@pytest.mark.gpu
@needs_cuda
def test_cuda_output_buffers_of_two_copies_in_flight_stay_apart() -> None:
    buffers = OutputBuffers()
    src = torch.arange(1000, device="cuda")
    torch.cuda._sleep(200_000_000)
    a = HostCopy([src * 2], buffers)
    b = HostCopy([src * 3], buffers)
    assert b.tolist() == [[3 * i for i in range(1000)]] and a.tolist() == [[2 * i for i in range(1000)]]
    torch.cuda._sleep(200_000_000)
    c = HostCopy([src + 5], buffers)  # a read set, reused
    assert buffers.slots_made == 2 and c.tolist() == [[i + 5 for i in range(1000)]]
