"""vLLM's ``repetition_penalty`` and ``min_tokens``: what they do to a choice's logits, and to greedy choices."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import openai
import pytest

from pie.generation.sampling import SamplingParams
from pie.runtime.llm import LLM
from pie.serve.engine import LARGEST_LOGIT, Delta, Done, Engine, GenerationRequest, _LogitAdjustments
from pie.testing.models import make_gguf_model, tiny_tokenizer
from pie.testing.serve_process import ServeProcess

GREEDY = SamplingParams(temperature=0.0)
PROMPT = (5, 8, 9)


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_tokens_seen() -> None:
    adjust = _LogitAdjustments(GenerationRequest(prompt_ids=(0, 1), max_tokens=4, repetition_penalty=2.0), frozenset())
    adjust.saw(2)
    raw = np.array([2.0, -2.0, 3.0, -1.0, 0.5], np.float32)
    assert adjust(raw, 1).tolist() == [1.0, -4.0, 1.5, -1.0, 0.5]
    assert raw.tolist() == [2.0, -2.0, 3.0, -1.0, 0.5], "the model's own row (log-probabilities read it) is kept"
    adjust.saw(2)  # seen twice is penalized once, as in transformers and vLLM
    assert adjust(raw, 2).tolist() == [1.0, -4.0, 1.5, -1.0, 0.5]


def test_a_repetition_penalty_near_0_lifts_a_positive_logit_to_float32s_largest_not_to_inf() -> None:
    """1e-300 is 0 in float32: a positive logit divided by it was +inf, and the request a 500 ("the next token's
    logits hold +inf")."""
    for penalty in (1e-300, 1e-40):
        request = GenerationRequest(prompt_ids=(0, 1, 2), max_tokens=4, repetition_penalty=penalty)
        adjusted = _LogitAdjustments(request, frozenset())(np.array([2.0, -2.0, 0.0, 1.0], np.float32), 0)
        assert adjusted.tolist() == [LARGEST_LOGIT, -2.0 * np.float32(penalty), 0.0, 1.0], penalty


def test_min_tokens_masks_the_stop_tokens_until_the_choice_has_that_many() -> None:
    request = GenerationRequest(prompt_ids=(0,), max_tokens=8, min_tokens=2, stop_token_ids=frozenset({3, 4}))
    adjust = _LogitAdjustments(request, held_back=frozenset({3}))
    raw = np.zeros(5, np.float32)
    assert adjust(raw, 1).tolist() == [0.0, 0.0, 0.0, -np.inf, 0.0]
    assert adjust(raw, 2).tolist() == [0.0] * 5


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_gguf_model(tmp_path_factory.mktemp("sampling") / "m.gguf", "F32", lm_head_scale=20.0)
    return LLM.load(str(path), "cpu")


def generate(llm: LLM, **fields: object) -> tuple[list[int], list[str], str | None]:
    """A greedy choice's tokens, the text each delta carried, and its finish reason, from an engine of its own."""
    engine = Engine(llm)

    async def main() -> list[object]:
        delivered: list[object] = []
        engine.start(asyncio.get_running_loop())
        try:
            request = GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY, **fields)  # type: ignore[arg-type]
            engine.submit(request, delivered.extend)
            deadline = time.monotonic() + 60
            while not any(isinstance(event, Done) for event in delivered) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            engine.stop()
        return delivered

    deltas = [event for event in asyncio.run(main()) if isinstance(event, Delta)]
    assert deltas, "the choice ended"
    return [token for delta in deltas for token in delta.token_ids], [delta.text for delta in deltas], \
        deltas[-1].finish_reason


def test_a_repetition_penalty_turns_greedy_decoding_away_at_its_first_repeat_and_not_before(llm: LLM) -> None:
    """A penalty only lowers the logits of tokens already seen, so the greedy path is the same up to the first token
    that repeats one of the prompt or the output, and leaves it there."""
    free, _, _ = generate(llm, max_tokens=24)
    repeats = [i for i, token in enumerate(free) if token in PROMPT or token in free[:i]]
    assert repeats, f"the model's greedy choice repeats itself within 24 tokens: {free}"
    first = repeats[0]
    penalized, _, _ = generate(llm, max_tokens=24, repetition_penalty=2.0)
    assert penalized[:first] == free[:first] and penalized[first] != free[first], (free, penalized)
    assert generate(llm, max_tokens=24, repetition_penalty=1.0)[0] == free


def test_min_tokens_holds_back_a_stop_token_and_a_stop_string(llm: LLM) -> None:
    free, texts, _ = generate(llm, max_tokens=24)
    stop_token = free[1]
    assert generate(llm, max_tokens=24, stop_token_ids=frozenset({stop_token}))[0] == free[:2]
    held, _, reason = generate(llm, max_tokens=24, min_tokens=4, stop_token_ids=frozenset({stop_token}))
    assert len(held) >= 4 and stop_token not in held[:4], held
    assert reason == "length" if len(held) == 24 else held[-1] == stop_token

    stop = next(char for text in texts for char in text if char.isprintable() and char != "\ufffd")
    early = next(i for i, text in enumerate(texts) if stop in text)
    min_tokens = early + 2
    later = next(i for i, text in enumerate(texts) if i >= min_tokens - 1 and stop in text)
    tokens, _, reason = generate(llm, max_tokens=24, min_tokens=min_tokens, stop=(stop,))
    assert (tokens, reason) == (free[: later + 1], "stop"), "the stop string is looked for from the min_tokens-th on"
    assert generate(llm, max_tokens=24, stop=(stop,))[0] == free[: early + 1]


def test_the_server_takes_both_fields_and_refuses_min_tokens_past_max_tokens(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=6, temperature=0,
                                      extra_body={"repetition_penalty": 1.3, "min_tokens": 6})
    assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="The quick brown", max_tokens=3, extra_body={"min_tokens": 4})
    assert refused.value.body["param"] == "min_tokens", refused.value.body
    assert refused.value.body["message"].startswith("min_tokens (4) is more than the 3 tokens"), refused.value.body
    for value in (0, 2.5):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           extra_body={"repetition_penalty": value})
        assert refused.value.body["param"] == "repetition_penalty", refused.value.body


def test_the_server_serves_a_repetition_penalty_near_0(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        reply = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=4, temperature=temperature,
                                          seed=1, extra_body={"repetition_penalty": 1e-300})
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")


def test_min_tokens_that_hold_back_every_token_a_choice_may_take_are_a_400_naming_it(client: openai.OpenAI,
                                                                                    server: ServeProcess) -> None:
    """Stop tokens that were the whole vocabulary, or every token an output constraint allowed, left no token to
    sample under min_tokens: a 500 ("the next token's logits hold only -inf"), whole or streamed."""
    every_token = list(range(tiny_tokenizer().get_vocab_size()))
    x_token = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "add_special_tokens": False}, timeout=30)
    [x] = x_token.json()["tokens"]
    for stream, fields in ((False, {"stop_token_ids": every_token}), (True, {"stop_token_ids": every_token}),
                           (False, {"stop_token_ids": [x], "guided_choice": ["x"]})):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny", prompt="The quick brown", max_tokens=4, stream=stream,
                                      extra_body={"min_tokens": 1, **fields})
        assert refused.value.body["param"] == "min_tokens", refused.value.body
        assert refused.value.body["message"].startswith("min_tokens (1) holds back the stop tokens"), refused.value.body
    all_but_x = every_token[:x] + every_token[x + 1:]
    reply = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=2, temperature=0,
                                      extra_body={"min_tokens": 1, "stop_token_ids": all_but_x})
    assert reply.choices[0].text.startswith("x"), "the one token not held back"
