"""The HTTP gateway through the official `openai` client, sync and async, against `tokenmill serve` on the
embedded model (one pool for the module, on free 127.0.0.1 ports): completions and chat, streamed and
not, n=2, logprobs, stop, seed reproducibility, usage, structured outputs, 400 / 401 / 404 / 429, tenants,
/metrics counts, cancel on disconnect (KV blocks freed), /health through SIGSTOP / SIGCONT of the only worker."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

try:  # the gateway and test extras; a worker-only install (the GPU machine) skips this module
    import fastapi  # noqa: F401
    import openai
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    pytest.skip("needs the gateway extra (pip install 'tokenmill[gateway]') and openai", allow_module_level=True)
from helpers_net import addr, free_port, process_tree, procs_ctx, wait_until

from tokenmill.client import AsyncClient, Client, Forbidden
from tokenmill.gateway.tenants import owner_of_key

KEY_A, KEY_B = "key-alpha", "key-beta"
MODEL = "embedded"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Pool:
    base_url: str
    port: int
    broker: str
    serve: Any

    def sync(self, key: str = KEY_A, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=120, **kw)

    def aio(self, key: str = KEY_A) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=120)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """`tokenmill serve`: broker, one worker (4 sequences at once, a broker queue of 2: a burst gets
    429; heartbeats every 0.2 s, so its KV load is seen at most that late), the gateway with two API keys."""
    tmp = tmp_path_factory.mktemp("gateway")
    port, front, back = free_port(), free_port(), free_port()
    with procs_ctx(tmp) as ps:
        serve = ps.spawn(["serve", "--port", str(port), "--frontend", addr(front), "--backend", addr(back),
                          "--max-num-seqs", "4", "--queue-size", "2", "--heartbeat-interval", "0.2",
                          "--api-key", KEY_A, "--api-key", KEY_B],
                         "serve")
        p = Pool(f"http://127.0.0.1:{port}/v1", port, addr(front), serve)

        def healthy() -> bool:
            assert serve.poll() is None, ps.dump_logs()
            try:
                return p.get("/health")[0] == 200
            except OSError:
                return False

        wait_until(healthy, 180, 0.2, "gateway /health 200")
        yield p
        # serve's own bound on a stop: the gateway's drain (30 s), the broker's (35 s), the workers' (30 s)
        t0 = time.monotonic()
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve still running 120 s after SIGINT: {process_tree(serve.pid)}\n"
                                 f"{ps.dump_logs()}") from None
        print(f"serve stopped {time.monotonic() - t0:.1f} s after SIGINT")


def _greedy(pool: Pool, prompt: str, n: int = 12) -> str:
    r = pool.sync().completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    return r.choices[0].text


# ---- completions -------------------------------------------------------------------------------------


def test_completion_with_usage(pool: Pool) -> None:
    r = pool.sync().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8 and r.usage.prompt_tokens >= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_matches_whole_answer_and_reports_usage(pool: Pool) -> None:
    whole = _greedy(pool, "Once upon a time")
    chunks = list(pool.sync().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_token_id_prompts_and_echo(pool: Pool) -> None:
    r = pool.sync().completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5, 6]], max_tokens=3, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.prompt_tokens == 6
    e = pool.sync().completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith("Hello there") and len(e.choices[0].text) > len("Hello there")


def test_completion_logprobs(pool: Pool) -> None:
    r = pool.sync().completions.create(model=MODEL, prompt="One, two, three,", max_tokens=5, temperature=0,
                                       logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 5 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    for tok, lp_tok, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert lp_tok <= 0 and abs(max(top.values()) - lp_tok) < 1e-4 and tok in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_stop_string_ends_the_choice_before_it(pool: Pool) -> None:
    whole = _greedy(pool, "Count: 1, 2, 3, 4,", 16)
    word = whole.split()[2]
    r = pool.sync().completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0,
                                       stop=[word])
    c = r.choices[0]
    assert c.finish_reason == "stop" and word not in c.text and whole.startswith(c.text)
    assert r.usage.completion_tokens < 16


def test_seed_reproducibility(pool: Pool) -> None:
    def sample(seed: int) -> str:
        r = pool.sync().completions.create(model=MODEL, prompt="My favourite word is", max_tokens=24,
                                           temperature=1.5, seed=seed)
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first  # 24 tokens at temperature 1.5: equal by chance is out of reach


# ---- chat ------------------------------------------------------------------------------------------


def test_chat_with_usage(pool: Pool) -> None:
    r = pool.sync().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    m = r.choices[0].message
    assert r.object == "chat.completion" and m.role == "assistant" and "Paris" in m.content
    assert r.usage.prompt_tokens > 10 and 1 <= r.usage.completion_tokens <= 16


def test_chat_without_max_tokens_runs_to_its_end(pool: Pool) -> None:
    """No max_tokens (the OpenAI default): as many as the context leaves; a short greedy answer ends on EOS."""
    r = pool.sync().chat.completions.create(model=MODEL, messages=CHAT, temperature=0)
    assert r.choices[0].finish_reason == "stop" and "Paris" in r.choices[0].message.content
    c = pool.sync().completions.create(model=MODEL, prompt="The capital of France is", temperature=0, stop=["."])
    assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens >= 1


def test_chat_content_parts_system_and_template_kwargs(pool: Pool) -> None:
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                             {"type": "text", "text": "of France?"}]}]
    r = pool.sync().chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"chat_template_kwargs": {"unused_variable": 1}})
    assert r.choices[0].message.content and r.usage.prompt_tokens > 10


def test_chat_stream_async_matches_whole_answer(pool: Pool) -> None:
    whole = pool.sync().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)

    async def streamed() -> tuple[list[Any], str]:
        async with pool.aio() as c:
            stream = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
            chunks = [ch async for ch in stream]
            return chunks, "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    chunks, text = asyncio.run(streamed())
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_n2_async_with_seed(pool: Pool) -> None:
    async def run() -> Any:
        async with pool.aio() as c:
            return await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0,
                                                   n=2, seed=7, extra_body={"ignore_eos": True})

    r = asyncio.run(run())
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 20  # max_tokens each
    again = asyncio.run(run())
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_chat_stream_n2(pool: Pool) -> None:
    texts = {0: "", 1: ""}
    for ch in pool.sync().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2, stream=True,
                                                  temperature=0):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] and texts[0] == texts[1]  # greedy: both choices equal


def test_chat_logprobs(pool: Pool) -> None:
    r = pool.sync().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4  # greedy


# ---- structured outputs ------------------------------------------------------------------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}


def test_chat_response_format_json_schema(pool: Pool) -> None:
    r = pool.sync().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    person = json.loads(r.choices[0].message.content or "")
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and type(person["age"]) is int
    assert r.choices[0].finish_reason == "stop"


def test_completion_json_object_and_guided_choice(pool: Pool) -> None:
    c = pool.sync()
    r = c.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=60, temperature=0,
                             extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)
    r = c.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                             extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


def test_structured_output_errors_are_400(pool: Pool) -> None:
    c = pool.sync()
    with pytest.raises(openai.BadRequestError) as e:  # refused by the worker: llguidance cannot compile it
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert e.value.status_code == 400 and "does not compile" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # refused by the gateway
        c.completions.create(model=MODEL, prompt="x", max_tokens=4,
                             extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert "at most one" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                  tools=[{"type": "function", "function": {"name": "f"}}])
    assert "tools are not supported" in str(e.value)
    assert _greedy(pool, "The capital of France is", 4)  # the worker goes on serving


# ---- errors ----------------------------------------------------------------------------------------


def test_400_bad_requests(pool: Pool) -> None:
    c = pool.sync()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # refused by the broker's sampling rules
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"min_tokens": 5})
    assert "min_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}])


def test_404_unknown_model_at_once(pool: Pool) -> None:
    t0 = time.monotonic()
    with pytest.raises(openai.NotFoundError) as e:
        pool.sync().chat.completions.create(model="no-such-model", messages=CHAT)
    assert time.monotonic() - t0 < 2.0 and e.value.status_code == 404


def test_401_without_a_valid_key(pool: Pool) -> None:
    with pytest.raises(openai.AuthenticationError):
        pool.sync(key="wrong").models.list()
    assert [m.id for m in pool.sync(key=KEY_B).models.list().data] == [MODEL]


def test_429_with_retry_after_under_a_burst(pool: Pool) -> None:
    async def burst() -> list[Any]:
        async with pool.aio() as c:
            async def one() -> Any:
                return await c.completions.with_raw_response.create(
                    model=MODEL, prompt="Tell me a long story", max_tokens=48, temperature=0)
            return await asyncio.gather(*(one() for _ in range(12)), return_exceptions=True)

    results = asyncio.run(burst())
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    ok = [r for r in results if not isinstance(r, BaseException)]
    assert limited and ok, results
    assert all(int(r.response.headers["retry-after"]) >= 1 for r in limited)
    assert all(r.parse().usage.completion_tokens == 48 for r in ok)


# ---- tenants, metrics, disconnects, health -------------------------------------------------------------


def _stream_request(pool: Pool, body: dict[str, Any], key: str = KEY_A) -> tuple[http.client.HTTPConnection, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", pool.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    return conn, conn.getresponse()


def _first_data(resp: Any) -> dict[str, Any]:
    while True:
        line = resp.readline()
        assert line, "stream ended early"
        if line.startswith(b"data: {"):
            return dict(json.loads(line[6:]))


LONG = {"model": MODEL, "messages": CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}


def _kv_idle(c: Client) -> bool:
    ws = c.stats()["workers"]
    return bool(ws) and all(w["running"] == 0 and w["free_blocks"] + w["cached_blocks"] == w["kv_blocks"]
                            for w in ws)


def test_a_tenant_cannot_see_or_cancel_another_tenants_job(pool: Pool) -> None:
    conn, resp = _stream_request(pool, LONG, KEY_A)
    try:
        job_id = _first_data(resp)["id"] + "-0"

        async def try_cancel(key: str) -> None:
            async with AsyncClient(pool.broker, owner=owner_of_key(key)) as c:
                await c.cancel(job_id)

        async def try_subscribe(key: str) -> None:
            async with AsyncClient(pool.broker, owner=owner_of_key(key)) as c:
                h = await c.subscribe(job_id)
                await h.next_events(timeout=10)

        with pytest.raises(Forbidden):
            asyncio.run(try_subscribe(KEY_B))  # nor see its tokens
        with pytest.raises(Forbidden):
            asyncio.run(try_cancel(KEY_B))
        asyncio.run(try_cancel(KEY_A))  # the owner may
        rest = resp.read()
        assert b'"code":"cancelled"' in rest and rest.endswith(b"data: [DONE]\n\n")
    finally:
        conn.close()


def test_closing_a_stream_frees_its_kv_blocks(pool: Pool) -> None:
    """The worker's blocks are back (as its heartbeat shows them, 0.2 s apart) within 2 s of the close;
    the worker aborts a cancelled request before its next step (engine loop), so this bounds the lag of the
    gateway noticing the closed connection plus the cancel's trip."""
    with Client(pool.broker) as c:
        wait_until(lambda: _kv_idle(c), 30, what="idle worker")
        before = c.stats()["counters"].get("cancels", 0)
        conn, resp = _stream_request(pool, LONG)
        _first_data(resp)
        _first_data(resp)
        wait_until(lambda: not _kv_idle(c), 10, what="blocks in use")
        closed = time.monotonic()
        conn.sock.shutdown(2)
        conn.close()
        wait_until(lambda: _kv_idle(c), 5, 0.02, what="blocks freed after the HTTP client left")
        freed = time.monotonic() - closed
        assert c.stats()["counters"]["cancels"] == before + 1
        assert freed < 2.0
        print(f"blocks freed {freed * 1000:.0f} ms after the close (stats polls included)")


def test_closing_a_whole_answer_request_cancels_it(pool: Pool) -> None:
    with Client(pool.broker) as c:
        wait_until(lambda: _kv_idle(c), 30, what="idle worker")
        before = c.stats()["counters"].get("cancels", 0)
        conn = http.client.HTTPConnection("127.0.0.1", pool.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4000,
                                                            "ignore_eos": True}),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"})
        wait_until(lambda: not _kv_idle(c), 10, what="blocks in use")
        conn.sock.shutdown(2)
        conn.close()
        wait_until(lambda: _kv_idle(c), 5, 0.02, what="blocks freed after the HTTP client left")
        assert c.stats()["counters"]["cancels"] == before + 1


def _metrics(pool: Pool) -> dict[str, float]:
    status, body = pool.get("/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_count_every_request(pool: Pool) -> None:
    n, tokens = 3, 5
    before = _metrics(pool)
    for i in range(n):
        pool.sync().completions.create(model=MODEL, prompt=f"Number {i}:", max_tokens=tokens, temperature=0)
    after = _metrics(pool)

    def delta(name: str) -> float:
        key = f"tokenmill:{name}"
        return after.get(key, 0.0) - before.get(key, 0.0)

    m = "{model_name=embedded}"
    assert delta("request_success_total{finished_reason=length,model_name=embedded}") == n
    assert delta(f"generation_tokens_total{m}") == n * tokens
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds",
                 "request_queue_time_seconds", "request_generation_tokens"):
        assert delta(f"{hist}_count{m}") == n, hist
    assert delta(f"inter_token_latency_seconds_count{m}") == n * (tokens - 1)
    assert delta(f"prompt_tokens_total{m}") > 0 and after[f"tokenmill:prefix_cache_queries_total{m}"] > 0
    assert after["tokenmill:num_workers{}"] == 1 and "tokenmill:kv_cache_usage_perc{}" in after
    assert "tokenmill:num_requests_running{}" in after and "tokenmill:num_preemptions_total{}" in after
    assert after["tokenmill:worker_engine_steps_total{worker=worker-0}"] > 0


def test_models_version_health(pool: Pool) -> None:
    assert json.loads(pool.get("/version")[1])["version"]
    status, body = pool.get("/health")
    assert status == 200 and json.loads(body)["workers"][0]["healthy"]


def _worker_pid(serve_pid: int) -> int:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == serve_pid and b"worker" in cmd:
            return int(d.name)
    raise AssertionError("no worker process found")


def test_health_503_within_5s_of_sigstop_and_200_after_sigcont(pool: Pool) -> None:
    """Last in the module: it stops the pool's only worker."""
    pid = _worker_pid(pool.serve.pid)
    wait_until(lambda: pool.get("/health")[0] == 200, 30, what="healthy before")
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        wait_until(lambda: pool.get("/health")[0] == 503, 5.0, 0.1, what="/health 503 after SIGSTOP")
        print(f"/health 503 {time.monotonic() - t0:.2f} s after SIGSTOP")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: pool.get("/health")[0] == 200, 30, 0.1, what="/health 200 after SIGCONT")
    assert _greedy(pool, "Back again:", 3)
