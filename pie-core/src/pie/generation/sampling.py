"""Samplers over one row of logits: greedy, temperature, top-k, top-p, min-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Draws tokens for one sequence; a seed makes the draws reproducible."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self._rng = np.random.default_rng(self.params.seed)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The filtered next-token distribution (float64, sums to 1)."""
        p = self.params
        z = np.asarray(logits, dtype=np.float64) / (p.temperature or 1.0)
        keep = np.ones(z.shape, dtype=bool)
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            keep &= z >= kth
        probs = np.exp(z - z.max())
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

    def sample(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(logits.argmax())  # the method: np.argmax's Python wrapper runs cold after a decode step
        probs = self.probabilities(logits)
        return int(self._rng.choice(probs.size, p=probs))
