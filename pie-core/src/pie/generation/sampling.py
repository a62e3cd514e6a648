"""Samplers over one row of logits: greedy, temperature, top-k, top-p, min-p, seeded."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np


class NonFiniteLogits(ValueError):
    """The logits of the next token hold NaN or +inf, or are all -inf: no token can be chosen.

    Raised instead of choosing one anyway (greedy would take the first NaN, a sampler would fail
    deep in numpy). The caller knows what made the logits (weights, a logit epilogue) and says so.
    """


GREEDY_BELOW = 1e-5
"""A temperature below this is greedy, as in vLLM: dividing by it would overflow float32's logits."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. A ``temperature`` of 0 (below :data:`GREEDY_BELOW`) is greedy.

    The filters apply in vLLM's order: ``min_p`` and ``top_k`` on the tempered distribution, then
    ``top_p`` on what they kept.
    """

    temperature: float = 0.0
    top_k: int = 0
    """Keep only the k most likely tokens (0: no limit)."""
    top_p: float = 1.0
    """Keep the smallest set of the tokens ``top_k`` and ``min_p`` kept whose probability reaches p."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one."""
    seed: int | None = None
    """Makes the draws reproducible (a non-negative integer)."""

    def __post_init__(self) -> None:
        # Written so that NaN fails every check: each comparison with NaN is false.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (_is_integer(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:  # 1 keeps only the most likely tokens, as vLLM's does
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (_is_integer(self.seed) and self.seed >= 0):
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_integer(value: object) -> bool:
    try:
        operator.index(value)  # type: ignore[arg-type]  # the point is to find out
    except TypeError:
        return False
    return True


MAX_TOP_TOKENS = 256
"""Most candidates a sampler takes instead of the whole row (a wider top_k samples from the logits)."""


@dataclass(frozen=True, eq=False)
class TopTokens:
    """The most likely tokens of a row (or ``[rows, k]`` of a batch), read on the device instead of its
    logits: ``indices`` most likely first, lower index first on ties; ``values`` their logits, None
    when only the argmax was read."""

    indices: np.ndarray
    values: np.ndarray | None

    def __getitem__(self, rows: int | slice) -> TopTokens:
        return TopTokens(self.indices[rows], None if self.values is None else self.values[rows])

    def __len__(self) -> int:
        return len(self.indices)


class Sampler:
    """Draws tokens for one sequence; a seed makes the draws reproducible.

    A draw is an exponential race: each kept token gets its own noise, a function of the step's key and
    of the token's id alone, and the token whose weight over its noise is largest wins. A token drawn
    this way moves only where a slight change of the logits reorders the race's leaders, so a seeded
    sequence draws the same tokens whatever else shares its batch (the batch's size moves logits by
    about 1e-4 on the CPU engine). An inverse CDF over the vocabulary moved with about one token in ten.
    """

    def __init__(self, params: SamplingParams | None = None):
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"sampling takes a SamplingParams (or None: greedy), not {type(params).__name__} {params!r}")
        self.params = params or SamplingParams()
        self._rng = np.random.default_rng(self.params.seed)

    def top_tokens_needed(self, vocab_size: int) -> int:
        """How many of a row's most likely tokens (:class:`TopTokens`) draw exactly what its whole logits
        would: 1 when greedy (the argmax), ``top_k`` (2 at least, so that their logits come too) when
        ``top_k`` keeps fewer than the vocabulary (``min_p`` and ``top_p`` choose among what it keeps);
        0 when the whole row is needed (no ``top_k``, or one wider than :data:`MAX_TOP_TOKENS`)."""
        p = self.params
        if p.greedy:
            return 1
        if not 0 < p.top_k < min(vocab_size, MAX_TOP_TOKENS + 1):
            return 0
        return max(p.top_k, 2)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The filtered next-token distribution (float64, sums to 1)."""
        p = self.params
        z = np.asarray(logits, dtype=np.float64)
        top = z.max()  # NaN anywhere makes it NaN
        _check_finite(top)
        if p.greedy:
            argmax = (z == top).astype(np.float64)
            return argmax / argmax.sum()
        z = (z - top) / p.temperature  # shifted before scaling: at most 0, so exp never overflows
        keep = np.ones(z.shape, dtype=bool)
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            keep &= z >= kth
        probs = np.exp(z)
        if p.min_p > 0:
            keep &= probs >= p.min_p  # the most likely token has weight 1
        probs = np.where(keep, probs, 0.0)
        if p.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            before = np.cumsum(probs[order]) - probs[order]
            nucleus = np.zeros_like(keep)
            nucleus[order[before < p.top_p * probs.sum()]] = True
            probs = np.where(nucleus, probs, 0.0)
        return probs / probs.sum()

    def sample(self, logits: np.ndarray | TopTokens) -> int:
        """A token drawn from :meth:`probabilities` (the argmax when greedy), from a row's logits or
        from its :class:`TopTokens` (at least :meth:`top_tokens_needed` of them: the same draw).

        Computed apart from it, in float32 and without sorting the vocabulary: a server samples every
        sequence of a batch on one thread between two steps, where the float64 distribution and its full
        sort cost milliseconds a token. The nucleus is found among the most likely tokens, taking more
        of them until their mass reaches ``top_p``.
        """
        p = self.params
        if isinstance(logits, TopTokens):
            return self._sample_top(logits)
        if p.greedy:
            token = int(logits.argmax())  # the method: np.argmax's Python wrapper runs cold after a decode step
            _check_finite(logits[token])  # argmax picks the first NaN, or +inf, or -inf when all are
            return token
        z = np.asarray(logits, dtype=np.float32)
        top = float(z.max())
        _check_finite(top)
        scaled = (z - np.float32(top)) * np.float32(1 / p.temperature)  # at most 0: exp never overflows
        weights = np.exp(scaled)
        floor = -math.inf
        if p.top_k and p.top_k < z.size:
            floor = float(np.partition(scaled, -p.top_k)[-p.top_k])
        if p.min_p > 0:
            floor = max(floor, math.log(p.min_p))  # p >= min_p * p_max, the most likely token having weight 1
        if floor > -math.inf:
            weights = np.where(scaled >= np.float32(floor), weights, np.float32(0))
        if p.top_p < 1:
            tokens = _nucleus(weights, p.top_p)
            return _race(tokens, weights[tokens], self._rng)
        return _race(None, weights, self._rng)

    def _sample_top(self, top: TopTokens) -> int:
        """:meth:`sample` over the most likely tokens: the tokens past the ``top_k``-th have no weight
        there, and the kept ones race with the noise of their ids, so the draw is the same. (Only where
        more tokens tie with the ``top_k``-th than were read does it differ: those past the last one read,
        the higher indices, are left out.)"""
        p = self.params
        if p.greedy:
            if top.values is not None:  # the argmax alone shows no logit: a NaN row goes unnoticed there
                _check_finite(float(top.values[0]))
            return int(top.indices[0])
        if not 0 < p.top_k <= len(top) or top.values is None:
            raise ValueError(f"sampling with {p} needs the whole row's logits, not its {len(top)} most likely tokens")
        z = np.asarray(top.values, dtype=np.float32)
        _check_finite(float(z[0]))
        scaled = (z - z[0]) * np.float32(1 / p.temperature)
        floor = float(scaled[p.top_k - 1])
        if p.min_p > 0:
            floor = max(floor, math.log(p.min_p))
        kept = scaled >= np.float32(floor)
        tokens = np.asarray(top.indices[kept], dtype=np.int64)
        weights = np.exp(scaled[kept])
        if p.top_p < 1:
            by_id = np.argsort(tokens)  # the whole row's nucleus breaks ties by id
            tokens, weights = tokens[by_id], weights[by_id]
            nucleus = _nucleus(weights, p.top_p)
            tokens, weights = tokens[nucleus], weights[nucleus]
        return _race(tokens, weights, self._rng)


def _check_finite(top: float) -> None:
    """``top`` is the row's largest logit (or the one argmax chose): it is finite for a usable row."""
    if not math.isfinite(top):
        what = "NaN" if math.isnan(top) else ("+inf" if top > 0 else "only -inf")
        raise NonFiniteLogits(f"the next token's logits hold {what}: no token can be chosen")


LIKELY_WEIGHT = math.exp(-16)
"""Weight (against the most likely token's 1) from which a token counts as likely: the nucleus is looked
for among these first."""

RACED_WEIGHT = math.exp(-10)
"""Weight (against the most likely token's 1) from which a token races with noise of its own: tens to
thousands of a language model's tokens, holding all but a few thousandths of the mass at temperature 1."""

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_REST_ID = np.array([2**63], np.uint64)
"""The id whose noise the tokens below RACED_WEIGHT race with, as one: no token has it."""


def _noise(key: np.uint64, ids: np.ndarray) -> np.ndarray:
    """Exponential noise (mean 1, float64), one per id, a function of ``key`` and the id alone: splitmix64's
    finalizer over ``key + id * golden gamma``, its top 53 bits a uniform in (0, 1)."""
    h = ids.astype(np.uint64) * _GAMMA + key
    h ^= h >> _SHIFTS[0]
    h *= _MIX[0]
    h ^= h >> _SHIFTS[1]
    h *= _MIX[1]
    h ^= h >> _SHIFTS[2]
    uniform = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return -np.log(uniform)


def _race(tokens: np.ndarray | None, weights: np.ndarray, rng: np.random.Generator) -> int:
    """The token (of ``tokens``, or the index when None) that wins an exponential race: the least
    noise / weight wins, which is a draw in proportion to ``weights``.

    Each token from :data:`RACED_WEIGHT` runs with the noise of its own id. The others run as one, whose
    arrival is exponential with rate their total weight; should they win, one of them is drawn by an
    inverse CDF in id order, in proportion to its weight (exact: which runner of a race wins does not
    depend on when the winner arrives; the others' total weight is the whole's less the raced ones', exact up
    to its rounding). A draw takes one key and one uniform from ``rng`` whatever it
    races, so the stream of draws never depends on the logits.
    """
    key = rng.integers(2**64, dtype=np.uint64)
    uniform = rng.random()
    raced = np.flatnonzero(weights >= RACED_WEIGHT)  # the most likely token has weight 1: never empty
    raced_weights = weights[raced]
    ids = raced if tokens is None else tokens[raced]
    arrivals = _noise(key, ids) / raced_weights
    winner = int(arrivals.argmin())
    rest_mass = float(weights.sum(dtype=np.float64)) - float(raced_weights.sum(dtype=np.float64))
    if rest_mass > 0 and float(_noise(key, _REST_ID)[0]) / rest_mass < arrivals[winner]:
        rest = np.flatnonzero((weights < RACED_WEIGHT) & (weights > 0))
        if rest.size:  # else the mass was the sums' rounding
            if tokens is not None:
                rest = rest[np.argsort(tokens[rest])]
            cumulative = np.cumsum(weights[rest], dtype=np.float64)
            pick = rest[min(int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right")), rest.size - 1)]
            return int(pick if tokens is None else tokens[pick])
    return int(ids[winner])


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of the most likely tokens whose share of ``weights`` reaches ``top_p``
    (each token kept whose more likely tokens hold less than ``top_p``).

    Sorted first are only the tokens from LIKELY_WEIGHT (hundreds, for a language model): every token
    left out is less likely than each of them, so when they reach ``top_p`` the nucleus is among them.
    Otherwise (a flat distribution) the whole vocabulary is sorted.
    """
    goal = top_p * float(weights.sum(dtype=np.float64))
    likely = np.flatnonzero(weights >= LIKELY_WEIGHT)
    for candidates in (likely, np.arange(weights.size)):
        ordered = candidates[np.argsort(-weights[candidates], kind="stable")]
        through = np.cumsum(weights[ordered], dtype=np.float64)
        before = through - weights[ordered]
        if through[-1] >= goal or candidates.size == weights.size:
            return ordered[before < goal]
    raise AssertionError("unreachable: the whole vocabulary always reaches the goal")
