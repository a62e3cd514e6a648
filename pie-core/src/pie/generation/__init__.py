"""Turning logits into tokens and tokens into text."""

from pie.generation.sampling import NonFiniteLogits, Sampler, SamplingParams, TopTokens
from pie.generation.stops import StopMatcher

__all__ = ["NonFiniteLogits", "Sampler", "SamplingParams", "StopMatcher", "TopTokens"]
