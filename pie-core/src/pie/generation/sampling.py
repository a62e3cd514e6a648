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


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    """Keep only the k most likely tokens (0: no limit)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p."""
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
        return self.temperature == 0


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
    """Draws tokens for one sequence; a seed makes the draws reproducible."""

    def __init__(self, params: SamplingParams | None = None):
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"sampling takes a SamplingParams (or None: greedy), not {type(params).__name__} {params!r}")
        self.params = params or SamplingParams()
        self._rng = np.random.default_rng(self.params.seed)

    def top_tokens_needed(self, vocab_size: int) -> int:
        """How many of a row's most likely tokens (:class:`TopTokens`) draw exactly what its whole logits
        would: 1 when greedy (the argmax), ``top_k`` (2 at least, so that their logits come too) when that
        is the only cut besides ``min_p``; 0 when the whole row is needed (``top_p`` weighs the whole
        vocabulary's mass, no ``top_k`` keeps every token)."""
        p = self.params
        if p.greedy:
            return 1
        if p.top_p < 1 or not 0 < p.top_k < min(vocab_size, MAX_TOP_TOKENS + 1):
            return 0
        return max(p.top_k, 2)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The filtered next-token distribution (float64, sums to 1)."""
        p = self.params
        z = np.asarray(logits, dtype=np.float64)
        top = z.max()  # NaN anywhere makes it NaN
        _check_finite(top)
        # Shifted before scaling: a tiny temperature then sends the others to -inf, never the top to inf.
        z = (z - top) / (p.temperature or 1.0)
        keep = np.ones(z.shape, dtype=bool)
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            keep &= z >= kth
        probs = np.exp(z)
        probs /= probs.sum()
        if p.min_p > 0:
            keep &= probs >= p.min_p * probs.max()
        if p.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            before = np.cumsum(probs[order]) - probs[order]
            nucleus = np.zeros_like(keep)
            nucleus[order[before < p.top_p]] = True
            keep &= nucleus
        probs = np.where(keep, probs, 0.0)
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
        tokens = None  # all of them
        if p.top_p < 1:
            tokens = _nucleus(weights, p.top_p)
            weights, scaled = weights[tokens], scaled[tokens]
        if floor > -math.inf:
            weights = np.where(scaled >= np.float32(floor), weights, np.float32(0))
        cumulative = np.cumsum(weights, dtype=np.float64)  # float32 would lose the tail behind large weights
        pick = int(np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right"))
        return pick if tokens is None else int(tokens[pick])

    def _sample_top(self, top: TopTokens) -> int:
        """:meth:`sample` over the most likely tokens: the tokens past the ``top_k``-th have no weight
        there, and the kept ones are summed in vocabulary order as there, so the draw is the same. (Only
        where more tokens tie with the ``top_k``-th than were read does it differ: those past the last
        one read, the higher indices, are left out.)"""
        p = self.params
        if p.greedy:
            if top.values is not None:  # the argmax alone shows no logit: a NaN row goes unnoticed there
                _check_finite(float(top.values[0]))
            return int(top.indices[0])
        if p.top_p < 1 or not 0 < p.top_k <= len(top) or top.values is None:
            raise ValueError(f"sampling with {p} needs the whole row's logits, not its {len(top)} most likely tokens")
        z = np.asarray(top.values, dtype=np.float32)
        _check_finite(float(z[0]))
        scaled = (z - z[0]) * np.float32(1 / p.temperature)
        floor = float(scaled[p.top_k - 1])
        if p.min_p > 0:
            floor = max(floor, math.log(p.min_p))
        kept = scaled >= np.float32(floor)
        tokens = top.indices[kept]
        order = np.argsort(tokens)
        cumulative = np.cumsum(np.exp(scaled[kept])[order], dtype=np.float64)
        pick = int(np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right"))
        return int(tokens[order[pick]])


def _check_finite(top: float) -> None:
    """``top`` is the row's largest logit (or the one argmax chose): it is finite for a usable row."""
    if not math.isfinite(top):
        what = "NaN" if math.isnan(top) else ("+inf" if top > 0 else "only -inf")
        raise NonFiniteLogits(f"the next token's logits hold {what}: no token can be chosen")


NUCLEUS_FLOOR = math.exp(-16)
"""Weight (against the most likely token's 1) above which the nucleus is looked for first."""


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of the most likely tokens whose share of ``weights`` reaches ``top_p``
    (each token kept whose more likely tokens hold less than ``top_p``).

    Sorted first are only the tokens above NUCLEUS_FLOOR (hundreds, for a language model): every token
    left out is less likely than each of them, so when they reach ``top_p`` the nucleus is among them.
    Otherwise (a flat distribution) the whole vocabulary is sorted.
    """
    goal = top_p * float(weights.sum(dtype=np.float64))
    likely = np.flatnonzero(weights >= NUCLEUS_FLOOR)
    for candidates in (likely, np.arange(weights.size)):
        ordered = candidates[np.argsort(-weights[candidates], kind="stable")]
        through = np.cumsum(weights[ordered], dtype=np.float64)
        before = through - weights[ordered]
        if through[-1] >= goal or candidates.size == weights.size:
            return ordered[before < goal]
    raise AssertionError("unreachable: the whole vocabulary always reaches the goal")
