"""The interactive `tokenmill chat`, driven through a pseudo-terminal (pexpect) as a user types: line
editing and history (readline: arrow keys, a history file), Ctrl-C stops a reply and returns to the prompt
with the conversation kept, slash commands that never reach the model, a spinner while the model loads, a
newline on Ctrl-D. Three drivers: the chat loop over a scripted reply (every command, exactly), the real
command on the embedded model in-process, and the real command through a broker (Ctrl-C cancels the job)."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_net import FAKE, REPO, addr, free_port, procs_ctx, wait_until, wait_workers

from tokenmill.cli.sampling_args import parse_value
from tokenmill.client import Client
from tokenmill.client.chat_repl import ChatSession, Delta, chat_loop

pexpect = pytest.importorskip("pexpect", reason="pexpect drives the chat REPL (a dev dependency)")

pytestmark = pytest.mark.timeout(300)
PROMPT = ">>> "
LEFT, UP = "\x1b[D", "\x1b[A"

# A reply that says what it was asked (the roles of the messages, the temperature), then 150 dots, 20 ms apart.
SCRIPTED = textwrap.dedent("""
    import sys, time
    from tokenmill.cli.sampling_args import parse_value
    from tokenmill.client.chat_repl import ChatSession, Delta, chat_loop
    calls = [0]
    def reply(messages, params):
        calls[0] += 1
        roles = ",".join(m["role"] for m in messages)
        yield Delta(f"call #{calls[0]} roles={roles} temperature={params['temperature']} ")
        for _ in range(150):
            time.sleep(0.02)
            yield Delta(".")
        yield Delta(" done", "stop")
    session = ChatSession({"temperature": 0.7, "max_tokens": 16}, parse_value)
    sys.exit(chat_loop(session, reply, __import__("pathlib").Path(sys.argv[1])))
""")


def _spawn(args: list[str], tmp: Path, **kw: object) -> pexpect.spawn:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_CACHE"},
           "XDG_STATE_HOME": str(tmp / "state"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TERM": "xterm"}
    # SIGINT back to its default in the child, as at a terminal: a test run started in the background of a
    # non-interactive shell ignores SIGINT, the child would inherit that, and Python then never raises
    # KeyboardInterrupt at the prompt (it installs its handler only over the default disposition).
    child = pexpect.spawn(sys.executable, args, cwd=str(REPO), env=env, encoding="utf-8", timeout=60,
                          dimensions=(50, 400), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                          **kw)  # type: ignore[arg-type]
    return child


def _turn_output(child: pexpect.spawn) -> str:
    child.expect_exact(PROMPT)
    return str(child.before)


def test_chat_loop_commands_editing_history_and_ctrl_c(tmp_path: Path) -> None:
    script = tmp_path / "repl.py"
    script.write_text(SCRIPTED)
    history = tmp_path / "history"
    child = _spawn([str(script), str(history)], tmp_path)
    try:
        child.expect_exact("Type /help for commands")
        child.expect_exact(PROMPT)
        child.sendline("/help")
        assert "/set NAME VALUE" in _turn_output(child)
        # line editing: the cursor moves left over "5" before "0." is typed
        child.send("/set temperature 5" + LEFT + "0.\r")
        assert "Set temperature to 0.5." in _turn_output(child)
        child.sendline("/set top_k many")
        assert "error: top-k: not a valid value: 'many'" in _turn_output(child)
        child.sendline("/set temperature 500")  # refused as the request would be
        assert "temperature must be in [0, 100]" in _turn_output(child)
        child.sendline("/nope")
        assert "Unknown command '/nope'" in _turn_output(child)
        child.send(UP + UP + UP + UP + "\r")  # history: four lines back is the edited /set
        assert "Set temperature to 0.5." in _turn_output(child)

        child.sendline("first question")  # the first line that reaches the reply
        child.expect(r"call #1 roles=user temperature=0\.5 \.{5}")
        child.sendintr()  # Ctrl-C: the reply stops, the prompt is back well before the 3 s it would take
        t0 = time.monotonic()
        stopped = _turn_output(child)
        assert time.monotonic() - t0 < 1.5 and " done" not in stopped
        child.sendline("second")  # the stopped exchange stays in the conversation
        child.expect(r"call #2 roles=user,assistant,user ")
        assert " done" in _turn_output(child)
        child.sendline("/set system You are terse.")
        _turn_output(child)
        child.sendline("/clear")
        assert "Cleared the conversation." in _turn_output(child)
        child.sendline("third")
        child.expect(r"call #3 roles=system,user ")
        _turn_output(child)
        child.sendintr()  # at the prompt: how to leave
        child.expect_exact("Use Ctrl-D or /bye to leave.")
        child.expect_exact(PROMPT)
        child.sendeof()  # Ctrl-D: a newline, so the shell prompt starts on its own line
        child.expect_exact("\r\n")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert "/set temperature 0.5" in history.read_text().splitlines()


def test_bye_leaves(tmp_path: Path) -> None:
    script = tmp_path / "repl.py"
    script.write_text(SCRIPTED)
    child = _spawn([str(script), str(tmp_path / "h")], tmp_path)
    child.expect_exact(PROMPT)
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


class _InterruptedOnce(ChatSession):
    """A Ctrl-C that lands after a line is read and before the turn has set its handler (its first step)."""

    def messages(self, line: str) -> list[dict[str, str]]:
        if line == "first":
            raise KeyboardInterrupt
        return super().messages(line)


def test_ctrl_c_between_reading_a_line_and_the_reply_drops_that_line_only(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n"))
    asked: list[str] = []

    def reply(messages: list[dict[str, str]], _params: dict[str, object]) -> Iterator[Delta]:
        asked.append(messages[-1]["content"])
        yield Delta("ok", "stop")

    session = _InterruptedOnce({"temperature": 0.0}, parse_value)
    assert chat_loop(session, reply) == 0  # not the KeyboardInterrupt that main() turns into exit status 130
    assert asked == ["second"]
    assert session.history == [{"role": "user", "content": "second"}, {"role": "assistant", "content": "ok"}]
    assert capsys.readouterr().out == "\nok\n"


def _max_ngram_repeats(text: str, n: int = 4) -> int:
    words = re.findall(r"\w+", text.lower())
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return max(grams.values(), default=0)


def test_chat_on_the_embedded_model(tmp_path: Path) -> None:
    """The real command: a spinner while the model loads, the README's haiku prompt with the chat defaults
    (greedy decoding looped on it: "a caché lies" forty times), Ctrl-C in a long reply, Ctrl-D."""
    child = _spawn(["-m", "tokenmill.cli.main", "chat", "--seed", "1", "--max-tokens", "96"], tmp_path)
    try:
        child.expect_exact("loading embedded", timeout=120)  # the spinner, before anything else
        child.expect_exact(PROMPT, timeout=180)
        child.sendline("Write a haiku about caches")
        reply = _turn_output(child)
        text = reply.split("\n", 1)[1] if "\n" in reply else reply
        assert len(re.findall(r"\w+", text)) >= 5 and _max_ngram_repeats(text) <= 3, text
        child.sendline("/set max-tokens 2000")
        _turn_output(child)
        child.sendline("Tell me a very long story about a dragon and a knight.")
        child.expect_exact("knight.\r\n", timeout=30)  # the line's echo, which the next pattern must not match
        child.expect(r"\w+ \w+ \w+", timeout=120)  # the reply is flowing
        child.sendintr()
        t0 = time.monotonic()
        child.expect_exact(PROMPT, timeout=20)
        assert time.monotonic() - t0 < 10
        child.sendeof()
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close()
    assert child.exitstatus == 0


@pytest.fixture
def slow_pool(tmp_path: Path) -> Iterator[str]:
    front, back = free_port(), free_port()
    with procs_ctx(tmp_path) as ps:
        ps.broker(front, back)
        ps.spawn(["worker", "--broker", addr(back), *FAKE, "--heartbeat-interval", "0.2", "--name", "slow"], "slow",
                 env={"TOKENMILL_FAKE_STEP_S": "0.05"})
        with Client(addr(front)) as c:
            wait_workers(c, 1)
        yield addr(front)


def test_chat_through_a_broker_ctrl_c_cancels_the_job(slow_pool: str, tmp_path: Path) -> None:
    child = _spawn(["-m", "tokenmill.cli.main", "chat", "--broker", slow_pool, "--model", "fake", "--max-tokens",
                    "3000"], tmp_path)  # under the fake worker's max_model_len (4096): the broker refuses more
    try:
        child.expect_exact(PROMPT, timeout=60)
        child.sendline("go on and on")
        child.expect(r"[a-z]{5}")
        with Client(slow_pool) as c:
            assert c.stats()["active_jobs"] == 1
            child.sendintr()
            child.expect_exact(PROMPT, timeout=10)
            wait_until(lambda: c.stats()["active_jobs"] == 0, 10, 0.1, "the job cancelled")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
