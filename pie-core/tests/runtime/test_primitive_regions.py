"""A region as numbered catalogue primitives (`pie.poem.primitives`), and each primitive's argument roles."""

from __future__ import annotations

import pytest

from pie.contract import RegionOp, RegionRequest
from pie.kernels import ARG_ROLES, BATCH_ROLES, CATALOG, PRIMITIVES
from pie.poem.primitives import Step, primitive_region

BATCH = ("slots", "qo_indptr", "kv_page_indices", "kv_page_indptr", "kv_last_page_lens")


def attention_region(layer: int, window: int = 0) -> RegionRequest:
    """append_kv then attention of one layer, as Poem offers it."""
    ops = (
        RegionOp("append_kv", ("pool", "k", "v", "slots"), None, (("layer", layer),)),
        RegionOp(
            "attention",
            ("q", "pool", *BATCH[1:]),
            "out",
            (("layer", layer), ("num_heads", 4), ("scale", 0.25), ("window", window), ("softcap", 0.0)),
        ),
    )
    return RegionRequest(f"L{layer}.attention", ops, ("q", "k", "v", "pool", *BATCH), ("out",))


def test_each_primitive_states_the_role_of_each_tensor_argument() -> None:
    roles = {"act", "index", "slots", "indptr", "weight", "table", "pool"}
    assert set(BATCH_ROLES) < roles
    for name in PRIMITIVES:
        if name == "epilogue":  # its inputs are its eta program's, in the program's order
            assert name not in ARG_ROLES
            continue
        arguments = CATALOG[name].signature.split(") ->")[0].lstrip("(").split(", *")[0].split(", ")
        assert len(ARG_ROLES[name]) == len(arguments), (name, arguments)
        assert set(ARG_ROLES[name]) <= roles, name


def test_fused_kernels_expand_into_their_chains_over_numbered_values() -> None:
    ops = (
        RegionOp("rms_norm_linear", ("x", "norm", "w", None), "h", (("eps", 1e-5),)),
        RegionOp("linear_add", ("h", "o", "x"), "y"),
    )
    program, layers = primitive_region(RegionRequest("mlp", ops, ("x", "norm", "w", "o"), ("y",)), PRIMITIVES, "test")
    assert layers == ()
    assert program.steps == (
        Step("rms_norm", (0, 1), 4, (("eps", 1e-5),), None),
        Step("linear", (4, 2, None), 5, (), None),
        Step("linear", (5, 3, None), 6, (), None),
        Step("add", (6, 0), 7, (), None),
    )
    assert program.outputs == (7,) and program.donated is None and program.pool_value is None
    assert program.input_roles() == ["act", "weight", "weight", "weight"]


def test_layers_become_scalars_so_that_every_layer_shares_one_program() -> None:
    first, first_layers = primitive_region(attention_region(3), PRIMITIVES, "test")
    second, second_layers = primitive_region(attention_region(5), PRIMITIVES, "test")
    assert first == second and hash(first) == hash(second)
    assert (first_layers, second_layers) == ((3,), (5,))
    append, attend = first.steps
    assert append.layer == attend.layer == 0
    assert first.donated == 3, "the pool input, written in place"
    assert first.pool_value == append.output and attend.inputs[1] == append.output, "attention reads the written pool"
    assert dict(attend.options) == {"num_heads": 4, "scale": 0.25}, "off window and softcap are dropped"
    assert first.input_roles() == ["act", "act", "act", "pool", "slots", "indptr", "index", "indptr", "index"]
    windowed, _ = primitive_region(attention_region(3, window=8), PRIMITIVES, "test")
    assert windowed != first and dict(windowed.steps[1].options)["window"] == 8


def test_a_kernel_the_engine_lacks_is_refused_by_name() -> None:
    region = RegionRequest("r", (RegionOp("softmax", ("x",), "y", (("temperature", 1.0),)),), ("x",), ("y",))
    with pytest.raises(KeyError, match="the test engine has no kernel 'softmax'"):
        primitive_region(region, ("add",), "test")
