"""The fused kernels' chains (`pie.poem.fusions`) against the catalogue and the decoder graph."""

from __future__ import annotations

import numpy as np
import pytest

from pie.kernels import REFERENCE
from pie.poem import build_decoder_graph, partition
from pie.poem.fusions import CHAINED, FUSED, FUSIONS, Fusion, Link
from pie.poem.graph import Op
from pie.testing.models import tiny_config


def _expand(fusion: Fusion, args: list[np.ndarray | None], options: dict[str, float]) -> np.ndarray:
    """The fused kernel computed as its chain of primitive references, the way an engine expands it."""
    result: np.ndarray | None = None
    for link in fusion.chain:
        inputs = [result if i == CHAINED else None if i is None else args[i] for i in link.inputs]
        result = REFERENCE[link.kind](*inputs, **{name: options[name] for name in link.options})
    assert result is not None
    return result


@pytest.mark.parametrize("fusion", FUSIONS, ids=lambda f: f.kernel)
def test_each_chain_computes_its_fused_kernel(fusion: Fusion) -> None:
    rng = np.random.default_rng(0)
    k, n = 16, 24
    shapes = {
        "rms_norm_linear": [(5, k), (k,), (n, k), (n,)],
        "linear_add": [(5, k), (n, k), (5, n)],
        "rms_norm_gate_up_silu": [(5, k), (k,), (n, k)],
    }[fusion.kernel]
    assert len(shapes) == fusion.arity
    args = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    options = {"eps": 1e-5} if any(link.options for link in fusion.chain) else {}
    np.testing.assert_allclose(_expand(fusion, args, options), REFERENCE[fusion.kernel](*args, **options), atol=1e-5)


def test_arguments_and_matching_follow_the_chain() -> None:
    graph = build_decoder_graph(tiny_config(num_layers=1))
    uses = graph.use_counts()
    found: dict[str, tuple[tuple[str | None, ...], dict[str, object]]] = {}
    for region in partition(graph):
        for start in range(len(region.ops)):
            for fusion in FUSIONS:
                window = region.ops[start : start + len(fusion.kinds)]
                if fusion.matches(window, uses):
                    found.setdefault(fusion.kernel, fusion.arguments(window))
    assert set(found) == set(FUSED)
    gate_up, options = found["rms_norm_gate_up_silu"]
    assert gate_up[1:] == ("w.L0.ln2", "w.L0.gate_up") and set(options) == {"eps"}
    down, _ = found["linear_add"]
    assert down[1] in ("w.L0.o", "w.L0.down") and down[2] is not None and down[0] != down[2]


def test_an_add_reads_its_chained_input_from_either_side_and_a_refused_bias_stops_a_match() -> None:
    fusion = FUSED["linear_add"]
    proj = Op("linear", ("x", "w", None), "p", ())
    for add in (Op("add", ("p", "r"), "y", ()), Op("add", ("r", "p"), "y", ())):
        assert fusion.matches([proj, add], {"p": 1}) and fusion.arguments([proj, add])[0] == ("x", "w", "r")
    biased = Op("linear", ("x", "w", "b"), "p", ())
    assert not fusion.matches([biased, Op("add", ("p", "r"), "y", ())], {"p": 1})
    assert Fusion("f", (Link("linear", (0, 1, 2)),)).matches([biased], {})
