"""Disaggregated prefill and decode with real processes on 127.0.0.1 (tiny-llama dummy workers, prefix caching
on): a prefill worker and a decode worker give the greedy output of one worker, the decode worker really
uses the KV blocks it was sent (prefix hits), and killing the prefill worker mid-transfer or the decode
worker mid-stream loses nothing: every job completes token-identical, gap-free by sequence number."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers_net import Procs, addr, free_port, procs_ctx, reference_greedy, wait_until, wait_workers

from tokenmill.client import Client, JobHandle, StreamEvent

pytestmark = pytest.mark.timeout(300)

HB = 0.2
BLOCK = 16


def _prompts(n: int, tag: str, body: int) -> list[str]:
    """Prompts sharing a leading system text (prefix caching on both sides), each > one KV block."""
    return [f"system: answer briefly. {'rules ' * 4}{tag} {i}: " + "xyz" * (body + i % 5) for i in range(n)]


def _tokens(h: JobHandle, head: Sequence[StreamEvent] = ()) -> tuple[list[int], str]:
    """The job's tokens and text (after the events `head` already read from its stream), gap-free."""
    ids: list[int] = []
    text = ""
    events = [*head, *h.stream(timeout=120)]
    for ev in events:
        assert ev.seq == len(ids), f"seq {ev.seq} after {len(ids)} tokens"
        ids += ev.token_ids
        text += ev.text
    assert events[-1].finish_reason == "length"
    return ids, text


def _submit(c: Client, prompts: list[str], max_tokens: int) -> list[JobHandle]:
    return [c.submit(pr, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for pr in prompts]


def _prefills_over(c: Client) -> int:
    k = c.stats()["counters"]
    return int(k.get("prefills", 0) + k.get("prefills_without_kv", 0))


def _workers(c: Client) -> dict[str, dict[str, Any]]:
    return {w["name"]: w for w in c.stats()["workers"]}


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[Procs, int, int]]:
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back)
        yield ps, front, back


def _serve(ps: Procs, front: int, back: int, prefill_args: Sequence[str], prompts: list[str], max_tokens: int,
           decode_hits: int = 0) -> dict[str, Any]:
    """Start a prefill and a decode worker, run the prompts, check them against one worker's greedy output;
    the broker's counters (once the decode worker's heartbeat reports `decode_hits` prefix hits)."""
    ps.worker(back, "--role", "prefill", *prefill_args, name="pf", hb=HB)
    ps.worker(back, "--role", "decode", name="dc", hb=HB)
    expected = reference_greedy(prompts, max_tokens)
    with Client(addr(front)) as c:
        wait_workers(c, 2)
        results = [_tokens(h) for h in _submit(c, prompts, max_tokens)]
        wait_until(lambda: _workers(c)["dc"]["prefix_hits"] >= decode_hits, 10, what="decode prefix hits")
        wait_until(lambda: _prefills_over(c) >= len(prompts), 10, what="every PREFILLED")  # (may trail DONE)
        counters: dict[str, Any] = c.stats()["counters"]
    assert results == expected
    return counters


def test_prefill_and_decode_workers_match_one_worker(pool: tuple[Procs, int, int]) -> None:
    prompts = _prompts(10, "same", 20)
    # The decode worker found the blocks it was sent: at least the full blocks of every prompt before its last
    # token (> 64 tokens each).
    counters = _serve(*pool, (), prompts, 24, decode_hits=len(prompts) * 4)
    assert counters["disaggregated_dispatches"] == len(prompts)
    assert counters["prefills"] == len(prompts)
    assert counters.get("prefills_without_kv", 0) == 0 and counters.get("kv_lost", 0) == 0


def test_kv_the_decode_worker_cannot_use_falls_back_to_computing_the_prompt(pool: tuple[Procs, int, int]) -> None:
    prompts = _prompts(4, "geometry", 20)
    counters = _serve(*pool, ("--block-size", "32"), prompts, 12)  # KV blocks of another size
    assert counters["prefills"] == len(prompts)  # sent, and refused by the decode worker
    assert pool[0].logs[2].read_text().count("kv_unusable") == len(prompts)


Heads = Callable[[Client, list[JobHandle]], list[list[StreamEvent]]]  # waits, returns events it read


def _kill_mid_run(ps: Procs, front: int, workers: int, victim: subprocess.Popen[bytes], prompts: list[str],
                  max_tokens: int, when: Heads) -> dict[str, Any]:
    """Submit the prompts, SIGKILL `victim` once `when` returns (the events it read from each stream), check
    every job against one worker's greedy output; the broker's counters."""
    expected = reference_greedy(prompts, max_tokens)
    with Client(addr(front)) as c:
        wait_workers(c, workers)
        handles = _submit(c, prompts, max_tokens)
        heads = when(c, handles)
        os.kill(victim.pid, signal.SIGKILL)
        results = [_tokens(h, head) for h, head in zip(handles, heads)]
        counters: dict[str, Any] = c.stats()["counters"]
    assert results == expected
    return counters


def test_prefill_worker_killed_mid_transfer_loses_nothing(pool: tuple[Procs, int, int]) -> None:
    ps, front, back = pool
    # A slow prefill side (2 jobs at a time, 32 tokens a step) so that the kill lands while prefills run.
    pf = ps.worker(back, "--role", "prefill", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
                   name="pf", hb=HB)
    ps.worker(back, "--role", "decode", name="dc", hb=HB)

    def mid_transfer(c: Client, handles: list[JobHandle]) -> list[list[StreamEvent]]:
        def some_done_some_running() -> bool:
            st = c.stats()
            busy = {w["name"]: w["prefilling"] for w in st["workers"]}
            return st["counters"].get("prefills", 0) >= 1 and busy.get("pf", 0) > 0

        wait_until(some_done_some_running, 60, 0.01, "some prefills done, some running")
        return [[] for _ in handles]

    counters = _kill_mid_run(ps, front, 2, pf, _prompts(8, "kill-prefill", 120), 16, mid_transfer)
    assert counters["workers_lost"] == 1 and counters["prefills"] >= 1
    assert counters["kv_lost"] >= 1
    # The decode worker computed at least one prompt itself because its KV was lost.
    assert "kv_lost" in ps.logs[2].read_text()


@pytest.mark.slow
def test_decode_worker_killed_mid_stream_loses_nothing(pool: tuple[Procs, int, int]) -> None:
    ps, front, back = pool
    ps.worker(back, "--role", "prefill", name="pf", hb=HB)
    victim = ps.worker(back, "--role", "decode", name="dc1", hb=HB)
    ps.worker(back, "--role", "decode", name="dc2", hb=HB)
    prompts = _prompts(12, "kill-decode", 20)

    def mid_stream(c: Client, handles: list[JobHandle]) -> list[list[StreamEvent]]:
        wait_until(lambda: all(_workers(c)[n]["inflight"] > 0 for n in ("dc1", "dc2")), 30,
                   what="both decode workers streaming")
        return [[next(iter(h.stream(timeout=60)))] for h in handles]  # every stream has begun

    counters = _kill_mid_run(ps, front, 3, victim, prompts, 120, mid_stream)
    assert counters["migrations"] >= 1
    # The migrated jobs were placed again on the prefill worker and the surviving decode worker.
    assert counters["disaggregated_dispatches"] > len(prompts)
    assert counters.get("seq_mismatch", 0) == 0
