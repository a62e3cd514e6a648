"""Turning logits into tokens and tokens into text."""

from pie.generation.sampling import Sampler, SamplingParams
from pie.generation.stops import StopMatcher

__all__ = ["Sampler", "SamplingParams", "StopMatcher"]
