"""Shared utilities of the broker/worker/client tests: free ports on 127.0.0.1, subprocesses that are
always killed at teardown, waiting helpers, and a tiny fake engine (for tests where the model is
irrelevant to what is checked, and to make a worker that is deliberately slow)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu"]
FAKE = ["--model", "fake", "--engine-factory", "tests.helpers_net:fake_engine"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def addr(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def http_request(port: int, method: str, path: str, body: dict[str, Any] | None = None, key: str | None = None,
                 timeout: float = 30.0) -> tuple[int, bytes]:
    """(status, body) of one HTTP request to 127.0.0.1:`port` on a connection of its own (JSON `body`,
    `key` as a bearer token)."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, json.dumps(body).encode() if body is not None else None, headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def wait_until(pred: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Procs:
    """Subprocesses of one test; `close()` (always called by the fixture) kills what is left."""

    tmp: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def spawn(self, args: Sequence[str], name: str, env: dict[str, str] | None = None,
              argv0: Sequence[str] | None = None) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}-{len(self.procs)}.log"
        full_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        cmd = [*(argv0 or [sys.executable, "-m", "tokenmill.cli.main"]), *args]
        with open(log, "wb") as f:
            pr = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
                                  start_new_session=True)
        self.procs.append(pr)
        self.logs.append(log)
        return pr

    def broker(self, front: int, back: int, *extra: str) -> subprocess.Popen[bytes]:
        return self.spawn(["broker", "--frontend", addr(front), "--backend", addr(back), *extra], "broker")

    def worker(self, back: int, *extra: str, model: Sequence[str] = TINY, hb: float = 0.2,
               name: str = "worker") -> subprocess.Popen[bytes]:
        return self.spawn(["worker", "--broker", addr(back), *model, "--heartbeat-interval", str(hb),
                           "--name", name, *extra], name)

    def dump_logs(self) -> str:
        out = []
        for log in self.logs:
            with contextlib.suppress(OSError):
                out.append(f"---- {log.name}\n{log.read_text()[-4000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for pr in self.procs:
            if pr.poll() is None:
                # `serve` / `up` start their broker and workers in sessions of their own (a terminal's Ctrl-C
                # reaches only the parent, which drains them in order): kill those groups as well
                for pid in (*_descendants(pr.pid), pr.pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGCONT)
                        os.killpg(pid, signal.SIGKILL)
        for pr in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                pr.wait(10)


def _descendants(pid: int) -> list[int]:
    """The live descendants of `pid` (from /proc; none where it cannot be read), children before their own."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def process_tree(pid: int) -> str:
    """`pid` and its live descendants as "pid state command" (from /proc), for a message on why a stop hangs."""
    rows = []
    for p in (pid, *_descendants(pid)):
        with contextlib.suppress(OSError, IndexError):
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            rows.append(f"{p} {state} {cmd.strip()[:100]}")
    return "; ".join(rows) or f"{pid} gone"


def wait_gateway(ps: Procs, gateway: subprocess.Popen[bytes], port: int, timeout: float = 120.0,
                 statuses: tuple[int, ...] = (200,)) -> None:
    """Wait until the gateway on `port` answers /health with one of `statuses` (fails at once if it exited)."""
    def answered() -> bool:
        assert gateway.poll() is None, ps.dump_logs()
        try:
            return http_request(port, "GET", "/health")[0] in statuses
        except OSError:
            return False

    wait_until(answered, timeout, 0.2, f"gateway /health in {statuses}")


@contextlib.contextmanager
def procs_ctx(tmp: Path) -> Iterator[Procs]:
    ps = Procs(tmp)
    try:
        yield ps
    except BaseException:
        sys.stderr.write(ps.dump_logs())
        raise
    finally:
        ps.close()


def wait_workers(client: Any, n: int, timeout: float = 120.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        try:
            st = client.stats(timeout=2.0)
        except Exception:
            return None
        return st if len(st["workers"]) >= n else None

    return wait_until(check, timeout, 0.2, f"{n} workers registered")


# ---- the engine in this process, as the reference ------------------------------------------------

_REFERENCE: list[Any] = []


def reference_greedy(prompts: Sequence[str], max_tokens: int) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt run greedily (ignore_eos) by tiny-llama in this process, on one
    thread (on a busy 2-core machine torch's default threading is ~15x slower here)."""
    import torch

    from tokenmill.protocol.sampling import SamplingParams
    from tokenmill.worker.config import EngineConfig
    from tokenmill.worker.engine import LLMEngine

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not _REFERENCE:
            _REFERENCE.append(LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu")))
        outs = _REFERENCE[0].generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True))
    finally:
        torch.set_num_threads(prev)
    return [(o.token_ids, o.text) for o in outs]


# ---- a fake engine ----------------------------------------------------------------------------------


@dataclass
class _FakeReq:
    prompt: list[int]
    out: list[int]
    max_tokens: int
    new_from: int


@dataclass(frozen=True)
class FakeStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_cached_blocks: int
    num_total_blocks: int
    block_size: int


class FakeEngine:
    """Deterministic engine stand-in: token at output position i of a prompt is a function of (prompt,
    i) only, so migrated requests continue identically; 'KV blocks' are counted per request."""

    def __init__(self, step_s: float = 0.0, total_blocks: int = 4096, block_size: int = 16) -> None:
        self.model_name = "fake"
        self.max_model_len = 4096
        self.step_s = step_s
        self.total_blocks, self.block_size = total_blocks, block_size
        self.reqs: dict[str, _FakeReq] = {}

    @staticmethod
    def token(prompt: Sequence[int], i: int) -> int:
        return 97 + (sum(prompt) * 31 + i * 7) % 26

    def add_request(self, request_id: str, prompt: str | None = None, *,
                    prompt_token_ids: Sequence[int] | None = None, messages: list[dict[str, Any]] | None = None,
                    params: Any = None, priority: int = 0, resume_token_ids: Sequence[int] = ()) -> None:
        from tokenmill.protocol import InvalidRequest

        if messages is not None:
            prompt = "".join(m["content"] for m in messages)
        ids = list(prompt.encode()) if prompt is not None else list(prompt_token_ids or [])
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(resume_token_ids) >= params.max_tokens:
            raise InvalidRequest("nothing left to generate")
        self.reqs[request_id] = _FakeReq(ids, list(resume_token_ids), params.max_tokens, len(resume_token_ids))

    def abort_request(self, request_id: str) -> bool:
        return self.reqs.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[Any]:
        from tokenmill.worker.outputs import RequestOutput, Usage

        if self.step_s:
            time.sleep(self.step_s)
        outs = []
        for rid, r in list(self.reqs.items()):
            i = len(r.out)
            tok = self.token(r.prompt, i)
            r.out.append(tok)
            done = len(r.out) >= r.max_tokens
            usage = Usage(len(r.prompt), len(r.out), 0) if done else None
            outs.append(RequestOutput(rid, [tok], chr(tok), i, finished=done,
                                      finish_reason="length" if done else None, usage=usage))
            if done:
                del self.reqs[rid]
        return outs

    def stats(self) -> FakeStats:
        used = sum(math.ceil((len(r.prompt) + len(r.out)) / self.block_size) for r in self.reqs.values())
        return FakeStats(len(self.reqs), 0, self.total_blocks - used, 0, self.total_blocks, self.block_size)


def fake_engine(args: Any) -> FakeEngine:
    return FakeEngine(step_s=float(os.environ.get("TOKENMILL_FAKE_STEP_S", "0.002")))


def fake_text(prompt: str, max_tokens: int) -> str:
    ids = list(prompt.encode())
    return "".join(chr(FakeEngine.token(ids, i)) for i in range(max_tokens))
