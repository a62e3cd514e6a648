"""Poem: the forward pass as a graph, fused into regions, lowered to an engine's kernels."""

from pie.poem.graph import Graph, Op, build_decoder_graph
from pie.poem.lower import Plan, lower
from pie.poem.regions import Region, partition

__all__ = ["Graph", "Op", "Plan", "Region", "build_decoder_graph", "lower", "partition"]
