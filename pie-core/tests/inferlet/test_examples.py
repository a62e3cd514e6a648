"""The inferlets in examples/, run on a tiny random model, checked against independent computations."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import pytest
from pie.inferlet import InferletHost, InferletMain, log_softmax
from pie.model.tokenizer import Tokenizer
from pie.runtime.model_runner import ModelRunner

HostFactory = Callable[..., InferletHost]


def run(host: InferletHost, main: InferletMain, args: list[str]) -> Any:
    result = asyncio.run(host.run(main, args, name="example"))
    assert result.ok, result.details or result.error
    return result.value


def assert_all_pages_back(host: InferletHost) -> None:
    core = host.scheduler.core
    assert core.runner.pages.free_count == core.runner.pages.num_pages
    if core.host is not None:
        assert core.host.free_count == core.host.num_pages
    assert core.sequences() == []


def sequence_logprob(helpers: Any, reference: ModelRunner, context: list[int], tokens: list[int]) -> float:
    rows = helpers.all_logits(reference, context + tokens)
    return float(sum(log_softmax(rows[len(context) - 1 + j])[t] for j, t in enumerate(tokens)))


def test_best_of_n_children_share_the_prompt_pages_and_the_best_is_the_likeliest(
    make_host: HostFactory, example: Callable[[str], InferletMain], reference: ModelRunner, helpers: Any
) -> None:
    host = make_host()
    n = 4
    value = run(
        host, example("best_of_n"), ["The quick brown fox", "--n", str(n), "--max-tokens", "6", "--temperature", "1.0"]
    )
    prompt = value["prompt_tokens"]
    page_size = host.scheduler.core.page_size
    assert len(prompt) % page_size, "the prompt should end in a partly filled page"
    refcounts = value["prompt_page_refcounts"]
    assert refcounts[:-1] == [n + 1] * (len(prompt) // page_size)  # full pages: shared by all
    assert refcounts[-1] < n + 1  # the partial page was copied by the children that wrote after it
    candidates = value["candidates"]
    assert len({tuple(c["tokens"]) for c in candidates}) > 1
    for candidate in candidates:
        expected = sequence_logprob(helpers, reference, prompt, candidate["tokens"])
        assert candidate["logprob"] == pytest.approx(expected, abs=1e-4)
    best = max(range(n), key=lambda i: candidates[i]["mean_logprob"])
    assert value["best_index"] == best and value["best"] == candidates[best]["text"]
    assert_all_pages_back(host)


ALLOWED = [50, 120, 300]


def constrained_table(
    helpers: Any, reference: ModelRunner, prompt: list[int], length: int
) -> dict[tuple[int, ...], dict[int, float]]:
    """Log-probabilities over ALLOWED (renormalized) after every prefix shorter than ``length``."""
    table = {}
    for size in range(length):
        for prefix in itertools.product(ALLOWED, repeat=size):
            logits = helpers.all_logits(reference, prompt + list(prefix))[-1]
            table[prefix] = dict(zip(ALLOWED, log_softmax(logits[ALLOWED]).tolist(), strict=True))
    return table


def simulated_beam_search(
    table: dict[tuple[int, ...], dict[int, float]], width: int, length: int
) -> list[tuple[list[int], float]]:
    beams: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    for _ in range(length):
        candidates = []
        for prefix, score in beams:
            options = sorted(ALLOWED, key=lambda t: -table[prefix][t])[:width]
            candidates += [(prefix + (t,), score + table[prefix][t]) for t in options]
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[:width]
    return [(list(prefix), score) for prefix, score in beams]


@pytest.mark.parametrize("width", [9, 2])
def test_beam_search_matches_a_brute_force_search(
    width: int,
    make_host: HostFactory,
    example: Callable[[str], InferletMain],
    reference: ModelRunner,
    tokenizer: Tokenizer,
    helpers: Any,
) -> None:
    host = make_host()
    length = 3
    allow = ",".join(map(str, ALLOWED))
    value = run(
        host,
        example("beam_search"),
        ["Pie serves", "--beams", str(width), "--max-tokens", str(length), "--allow-ids", allow],
    )
    table = constrained_table(helpers, reference, tokenizer.encode("Pie serves"), length)
    every = {
        seq: sum(table[seq[:i]][seq[i]] for i in range(length)) for seq in itertools.product(ALLOWED, repeat=length)
    }
    beams = value["beams"]
    if width >= len(ALLOWED) ** (length - 1):
        # Wide enough to be exhaustive: the beams are exactly the best sequences of all 27.
        best = sorted(every, key=lambda s: -every[s])[:width]
        assert [tuple(b["tokens"]) for b in beams] == best
        assert beams[0]["logprob"] == pytest.approx(max(every.values()), abs=1e-4)
    expected = simulated_beam_search(table, width, length)
    assert [b["tokens"] for b in beams] == [tokens for tokens, _ in expected]
    for beam, (tokens, score) in zip(beams, expected, strict=True):
        assert beam["logprob"] == pytest.approx(score, abs=1e-4)
        assert beam["logprob"] == pytest.approx(every[tuple(tokens)], abs=1e-4)
    assert_all_pages_back(host)


def test_constrained_choice_is_the_greedy_answer_among_tokens_that_continue_an_option(
    make_host: HostFactory,
    example: Callable[[str], InferletMain],
    reference: ModelRunner,
    tokenizer: Tokenizer,
    helpers: Any,
) -> None:
    pytest.importorskip("llguidance", reason="constrained generation needs the grammar extra")
    host = make_host()
    options = [" yes", " no", " maybe", " the lazy dog", " 12345"]
    args = ["Is the fox quick?"] + [arg for option in options for arg in ("--option", option)]
    value = run(host, example("constrained_choice"), args)
    # Computed apart, without the grammar engine: at each step the likeliest token whose text keeps the
    # answer a prefix of some option, until it is one.
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in range(tokenizer.vocab_size)]
    text, tokens = "", []
    while text not in options:
        logits = helpers.all_logits(reference, value["prompt_tokens"] + tokens)[-1]
        allowed = [t for t, piece in enumerate(pieces) if piece and any(o.startswith(text + piece) for o in options)]
        tokens.append(max(allowed, key=lambda t: logits[t]))
        text += pieces[tokens[-1]]
    assert value["tokens"] == tokens and value["choice"] == text
    assert_all_pages_back(host)


def test_constrained_choice_samples_in_forks_each_with_its_own_matcher(
    make_host: HostFactory, example: Callable[[str], InferletMain]
) -> None:
    pytest.importorskip("llguidance", reason="constrained generation needs the grammar extra")
    host = make_host()
    options = [" yes", " no", " the lazy dog", " 12345"]
    args = ["Is the fox quick?", "--samples", "12", "--temperature", "1.5", "--seed", "7"]
    value = run(host, example("constrained_choice"), args + [arg for option in options for arg in ("--option", option)])
    answers = value["answers"]
    assert len(answers) == 12 and set(answers) <= set(options)
    assert len(set(answers)) > 1, "sampled forks all gave one answer"
    assert value["counts"] == {option: answers.count(option) for option in options}
    assert value["counts"][value["choice"]] == max(value["counts"].values())
    assert_all_pages_back(host)


def test_two_agents_share_the_instructions_and_each_turn_is_the_greedy_continuation(
    make_host: HostFactory,
    example: Callable[[str], InferletMain],
    reference: ModelRunner,
    helpers: Any,
) -> None:
    host = make_host()
    max_tokens = 6
    value = run(host, example("two_agents"), ["the lazy dog", "--turns", "4", "--max-tokens", str(max_tokens)])
    turns = value["turns"]
    assert [t["speaker"] for t in turns] == ["Ada", "Bob", "Ada", "Bob"]
    shared = value["shared_tokens"]
    refcounts = value["shared_page_refcounts"]
    page_size = host.scheduler.core.page_size
    full = len(shared) // page_size
    assert refcounts[:full] == [3] * full  # the shared context and both agents
    if len(shared) % page_size:
        assert refcounts[full] == 1  # both agents wrote after it: each has its own copy
    for number, turn in enumerate(turns):
        context = turn["context_before"]
        assert context[: len(shared)] == shared
        produced = turn["tokens"]
        expected = helpers.greedy(reference, context, len(produced) + (len(produced) < max_tokens))
        assert expected[: len(produced)] == produced
        if len(produced) < max_tokens:
            assert expected[-1] == 2  # stopped at the end-of-turn token
        if number:
            # The listener's context holds the previous reply it was told.
            previous = turns[number - 1]
            assert previous["text"] in host.tokenizer.decode(context)
    assert_all_pages_back(host)
