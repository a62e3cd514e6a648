"""A system prompt shared by many requests is computed once: later requests start from its cached pages."""

from __future__ import annotations

from pathlib import Path

import openai
from pie.testing.serve_process import ServeProcess

SYSTEM = "You are a careful assistant who answers in one short sentence and never repeats the question. " * 2
QUESTIONS = ["What is a fox?", "Why are dogs lazy?", "Where is Köln?", "What is a fox?"]


def test_a_shared_system_prompt_hits_the_prefix_cache_with_identical_tokens(tiny_model: Path) -> None:
    answers, cached, hits = {}, {}, {}
    for flag in ("--prefix-cache", "--no-prefix-cache"):
        with ServeProcess("--model", str(tiny_model), "--served-model-name", "tiny", flag) as server:
            server.wait_ready()
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
            replies = [
                client.chat.completions.create(
                    model="tiny", max_tokens=12, temperature=0,
                    messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
                for question in QUESTIONS
            ]
            answers[flag] = [r.choices[0].message.content for r in replies]
            cached[flag] = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
            hits[flag] = server.metrics()["pie:prefix_cache_hits_total"]
            assert server.stop() == 0
    assert answers["--prefix-cache"] == answers["--no-prefix-cache"]
    on = cached["--prefix-cache"]
    assert on[0] == 0 and all(c >= 16 for c in on[1:]), on
    assert on[3] > on[1], "the repeated question reuses the pages of its whole prompt but the last"
    assert hits["--prefix-cache"] == sum(on) and cached["--no-prefix-cache"] == [0] * 4 and hits["--no-prefix-cache"] == 0


def test_a_cache_salt_keeps_a_prompt_from_other_salts(tiny_model: Path) -> None:
    """A client could tell from ``cached_tokens`` whether another client's prompt began with a guess; vLLM's
    ``cache_salt`` keeps each salt's pages to itself."""
    with ServeProcess("--model", str(tiny_model), "--served-model-name", "tiny") as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

        def cached(salt: str | None) -> int:
            extra = {} if salt is None else {"cache_salt": salt}
            reply = client.chat.completions.create(
                model="tiny", max_tokens=2, temperature=0, extra_body=extra,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}])
            return reply.usage.prompt_tokens_details.cached_tokens

        assert [cached(salt) for salt in ("secret-a", None, "secret-b")] == [0, 0, 0]
        assert cached("secret-a") >= 16 and cached(None) >= 16
        try:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=1, extra_body={"cache_salt": ""})
            raise AssertionError("an empty salt was taken")
        except openai.BadRequestError as refused:
            assert refused.param == "cache_salt", refused.body
        assert server.stop() == 0
