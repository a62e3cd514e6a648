"""SamplingParams refuses what cannot sample; the sampler refuses logits no token can be chosen from."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pie import kernels
from pie.generation import NonFiniteLogits, Sampler, SamplingParams, TopTokens
from pie.generation.sampling import MAX_TOP_TOKENS, _nucleus

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", NAN),
        ("temperature", INF),
        ("temperature", -0.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", NAN),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", NAN),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("seed", -1),
        ("seed", 1.5),
    ],
)
def test_nonsense_params_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sensible_params_are_kept() -> None:
    params = SamplingParams(temperature=0.7, top_k=np.int64(5), top_p=0.9, min_p=0.05, seed=2**70)
    assert params.top_k == 5 and not params.greedy
    assert SamplingParams(temperature=-0.0).greedy


@pytest.mark.parametrize(
    ("poison", "named"),
    [(NAN, "NaN"), (INF, r"\+inf")],
)
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=0)], ids=["greedy", "sampled"])
def test_non_finite_logits_are_an_error_not_a_token(params: SamplingParams, poison: float, named: str) -> None:
    logits = np.zeros(50, np.float32)
    logits[7] = poison
    with pytest.raises(NonFiniteLogits, match=named):
        Sampler(params).sample(logits)


def test_logits_all_minus_inf_are_an_error() -> None:
    with pytest.raises(NonFiniteLogits, match="only -inf"):
        Sampler().sample(np.full(8, -np.inf, np.float32))
    with pytest.raises(NonFiniteLogits, match="only -inf"):
        Sampler(SamplingParams(temperature=1.0)).probabilities(np.full(8, -np.inf, np.float32))


def test_min_p_of_one_keeps_only_the_most_likely_tokens() -> None:
    """The top of vLLM's range, which this one once refused."""
    logits = np.array([1.0, 3.0, 3.0, 2.0], np.float32)
    params = [SamplingParams(temperature=1.0, min_p=1.0, seed=seed) for seed in range(20)]
    assert {Sampler(p).sample(logits) for p in params} == {1, 2}
    np.testing.assert_allclose(Sampler(params[0]).probabilities(logits), [0, 0.5, 0.5, 0])


def test_masked_logits_still_sample() -> None:
    logits = np.full(10, -np.inf, np.float32)
    logits[[3, 6]] = (1.0, 2.0)
    assert Sampler().sample(logits) == 6
    draws = {Sampler(SamplingParams(temperature=1.0, seed=s)).sample(logits) for s in range(20)}
    assert draws == {3, 6}


def test_a_tiny_temperature_is_greedy_not_nan() -> None:
    logits = np.array([1.0, 3.0, 2.0], np.float32)
    probs = Sampler(SamplingParams(temperature=1e-300)).probabilities(logits)
    np.testing.assert_array_equal(probs, [0.0, 1.0, 0.0])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-39), SamplingParams(temperature=1e-39, top_k=5),
                                    SamplingParams(temperature=1e-40, top_p=0.9)])
def test_a_temperature_too_small_to_divide_by_is_greedy(params: SamplingParams) -> None:
    """1 / 1e-39 is inf in float32, and (0 * inf) NaN: the draw was once past the vocabulary's end."""
    logits = (np.random.default_rng(5).standard_normal(1000) * 3).astype(np.float32)
    sampler = Sampler(params)
    assert params.greedy and sampler.top_tokens_needed(1000) == 1
    assert sampler.sample(logits) == int(logits.argmax())
    assert sampler.sample(_top(logits, 1)) == int(logits.argmax())
    assert sampler.probabilities(logits).argmax() == logits.argmax()


def test_greedy_probabilities_are_the_argmax() -> None:
    logits = np.array([1.0, 3.0, 3.0, 2.0], np.float32)
    np.testing.assert_array_equal(Sampler().probabilities(logits), [0, 0.5, 0.5, 0])


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, top_k=2, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.5, top_p=0.5)],
)
def test_top_p_weighs_what_top_k_and_min_p_kept(params: SamplingParams) -> None:
    """vLLM's order: of [0.3, 0.2, 10 x 0.05], top_k=2 (or min_p=0.5) keeps 0.6 and 0.4, of which top_p=0.5
    keeps the first alone. Measured over the whole vocabulary the nucleus held both."""
    logits = np.log(np.array([0.30, 0.20] + [0.05] * 10)).astype(np.float32)
    np.testing.assert_allclose(Sampler(params).probabilities(logits), [1.0] + [0.0] * 11)
    seeded = [Sampler(SamplingParams(**{**params.__dict__, "seed": seed})) for seed in range(30)]
    assert {sampler.sample(logits) for sampler in seeded} == {0}


def test_seeded_draws_hardly_move_when_the_logits_move_slightly() -> None:
    """The same seed over logits that differ by 5e-4 (a batch's size moves the CPU engine's by about that):
    the race keeps the draw. An inverse CDF over the vocabulary changed about one draw in eight."""
    rng = np.random.default_rng(11)
    moved = 0
    for seed in range(200):
        logits = (rng.standard_normal(20_000) * 2).astype(np.float32)
        jitter = (rng.uniform(-5e-4, 5e-4, logits.size)).astype(np.float32)
        params = SamplingParams(temperature=1.0, seed=seed)
        moved += Sampler(params).sample(logits) != Sampler(params).sample(logits + jitter)
    assert moved <= 4


def test_unlikely_tokens_are_drawn_as_often_as_their_mass() -> None:
    """Tokens below RACED_WEIGHT race as one: with most of the mass among them they still win as often
    as they weigh, and each in proportion to its own weight."""
    weights = np.full(100_001, np.float32(math.exp(-17)))
    weights[[0, 50_000]] = 1  # two likely tokens, with about a third of the mass
    logits = np.log(weights)
    expected = Sampler(SamplingParams(temperature=1.0)).probabilities(logits)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=9))
    draws = np.array([sampler.sample(logits) for _ in range(4_000)])
    for token in (0, 50_000):
        assert abs((draws == token).mean() - expected[token]) < 0.03
    unlikely = draws[(draws != 0) & (draws != 50_000)]
    assert len(set(unlikely.tolist())) > 0.9 * unlikely.size, "spread over the unlikely tokens, not one of them"


def test_temperature_scales_the_distribution() -> None:
    logits = np.log(np.array([0.2, 0.3, 0.5]))
    np.testing.assert_allclose(Sampler(SamplingParams(temperature=1.0)).probabilities(logits), [0.2, 0.3, 0.5])
    hot = Sampler(SamplingParams(temperature=2.0)).probabilities(logits)
    np.testing.assert_allclose(hot, np.sqrt([0.2, 0.3, 0.5]) / np.sqrt([0.2, 0.3, 0.5]).sum())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=1.0, min_p=0.1, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.7),
        SamplingParams(temperature=40.0, top_p=0.5),
        SamplingParams(temperature=0.05, top_p=0.99),
    ],
)
def test_sample_draws_from_the_distribution_probabilities_gives(params: SamplingParams) -> None:
    logits = (np.random.default_rng(3).standard_normal(50) * 2).astype(np.float32)
    sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": 1}))
    expected = sampler.probabilities(logits)
    draws = np.bincount([sampler.sample(logits) for _ in range(20_000)], minlength=50) / 20_000
    assert draws[expected == 0].sum() == 0, "never a token the filters drop"
    assert 0.5 * np.abs(draws - expected).sum() < 0.04


def test_a_nucleus_past_the_first_look_is_found_in_the_whole_vocabulary() -> None:
    # Ten likely tokens and 200,000 each below the first look's floor that together hold a share of about 8e-4.
    weights = np.full(200_010, np.float32(math.exp(-17)))
    weights[:10] = 1
    nucleus = _nucleus(weights, 0.9999)
    assert 10 < nucleus.size < weights.size and set(range(10)) <= set(nucleus.tolist())
    assert _nucleus(weights, 0.45).tolist() == [0, 1, 2, 3, 4], "ties go to the lower index, as probabilities() does"


def test_seeded_samplers_draw_the_same_tokens() -> None:
    logits = (np.random.default_rng(4).standard_normal(300) * 2).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=123)
    first, second = Sampler(params), Sampler(params)
    assert [first.sample(logits) for _ in range(50)] == [second.sample(logits) for _ in range(50)]


# -- drawing from the most likely tokens (read on the device) ------------------------------------


def _top(logits: np.ndarray, k: int) -> TopTokens:
    values, indices = kernels.top_k(logits[None], k=k)
    return TopTokens(indices[0], values[0])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=5, seed=3),
        SamplingParams(temperature=1.3, top_k=40, seed=4),
        SamplingParams(temperature=0.7, top_k=40, min_p=0.05, seed=5),
        SamplingParams(temperature=1.0, top_k=1, seed=6),
        SamplingParams(temperature=1.1, top_k=30, top_p=0.8, seed=7),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.6, min_p=0.02, seed=8),
    ],
)
def test_top_tokens_draw_what_the_whole_row_draws(params: SamplingParams) -> None:
    rng = np.random.default_rng(0)
    whole, top = Sampler(params), Sampler(params)
    assert whole.top_tokens_needed(1000) == max(params.top_k, 2)
    for step in range(300):
        logits = (rng.standard_normal(1000) * 3).astype(np.float32)
        k = 1 << (whole.top_tokens_needed(1000) - 1).bit_length()  # what the runner rounds up to
        if step % 3 == 0:  # ties: at the top, and across the k-th token (within the k read)
            order = np.argsort(-logits)
            logits[order[1]] = logits[order[0]]
            logits[order[params.top_k]] = logits[order[params.top_k - 1]]
        assert top.sample(_top(logits, k)) == whole.sample(logits), step


def test_greedy_takes_the_argmax_and_checks_its_logit() -> None:
    logits = np.array([0.5, 2.0, 2.0, -1.0], np.float32)
    assert Sampler().top_tokens_needed(4) == 1
    assert Sampler().sample(TopTokens(np.array([1], np.int32), None)) == 1
    assert Sampler().sample(_top(logits, 2)) == 1
    with pytest.raises(NonFiniteLogits, match=r"\+inf"):
        Sampler().sample(TopTokens(np.array([3, 1], np.int32), np.array([INF, 2.0], np.float32)))


@pytest.mark.parametrize(
    ("params", "vocab"),
    [
        (SamplingParams(temperature=1.0), 100),  # no top_k: every token may be drawn
        (SamplingParams(temperature=1.0, top_k=100), 100),  # keeps the whole vocabulary
        (SamplingParams(temperature=1.0, top_k=MAX_TOP_TOKENS + 1), 10_000),
    ],
)
def test_samplers_that_need_the_whole_row_say_so(params: SamplingParams, vocab: int) -> None:
    sampler = Sampler(params)
    assert sampler.top_tokens_needed(vocab) == 0
    logits = np.linspace(0, 1, vocab, dtype=np.float32)
    with pytest.raises(ValueError, match="needs the whole row's logits"):
        sampler.sample(_top(logits, 8))


def test_too_few_top_tokens_are_refused() -> None:
    logits = np.linspace(0, 1, 50, dtype=np.float32)
    with pytest.raises(ValueError, match="not its 4 most likely tokens"):
        Sampler(SamplingParams(temperature=1.0, top_k=8)).sample(_top(logits, 4))
