"""The host side of catalogue kernels the device engines share (pie.enginekit.catalogue)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pie.contract import KernelRequest
from pie.enginekit.catalogue import (
    AttentionOptions,
    EpilogueProgram,
    attention_request,
    check_add,
    check_append_kv,
    check_bias_and_norm,
    check_indices,
    check_norm_weight,
    check_page_tables,
    check_residual,
    check_rope,
    check_silu_mul,
    embedding_launcher,
    pool_layer,
    projection_launcher,
)
from pie.enginekit.engine import PassPlanEngine
from pie.enginekit.transfers import checked_page_ids
from pie.kernels import PROJECTIONS


def test_each_projection_maps_its_catalogue_arguments_onto_one_run() -> None:
    calls: list[tuple] = []
    launchers = {name: projection_launcher(name, lambda *args: calls.append(args) or "out") for name in PROJECTIONS}
    assert launchers["linear"]("x", "w") == "out"
    launchers["linear"]("x", "w", "b")
    launchers["rms_norm_linear"]("x", "n", "w")
    launchers["rms_norm_linear"]("x", "n", "w", "b")
    launchers["linear_add"]("x", "w", "r")
    launchers["rms_norm_gate_up_silu"]("x", "n", "gu")
    assert calls == [
        ("x", "w", None, None, None),
        ("x", "w", "b", None, None),
        ("x", "w", None, None, "n"),
        ("x", "w", "b", None, "n"),
        ("x", "w", None, "r", None),
        ("x", "gu", None, None, "n"),
    ]
    assert {name: launcher.__name__ for name, launcher in launchers.items()} == {name: name for name in PROJECTIONS}
    with pytest.raises(ValueError, match="'add' is not a projection"):
        projection_launcher("add", lambda *args: None)


def test_embedding_is_gather_rows_with_its_arguments_swapped() -> None:
    assert embedding_launcher(lambda table, rows: (table, rows))("ids", "table") == ("table", "ids")


def test_attention_options_are_read_once_with_their_defaults() -> None:
    plain = KernelRequest("attention", None, (("layer", 3), ("num_heads", 8), ("scale", 0.125)))
    assert attention_request(plain) == AttentionOptions(3, 8, 0.125, 0, 0.0)
    windowed = KernelRequest("attention", None, (*plain.options, ("window", 64), ("softcap", 30.0)))
    assert attention_request(windowed) == AttentionOptions(3, 8, 0.125, 64, 30.0)


def test_a_layer_of_the_page_pool_is_its_bytes_and_a_missing_one_is_refused() -> None:
    pool = SimpleNamespace(shape=(4, 10, 2, 16, 2, 8), nbytes=4 * 10 * 2 * 16 * 2 * 8 * 4)
    assert pool_layer(pool, 0) == (0, pool.nbytes // 4)
    assert pool_layer(pool, 3) == (3 * pool.nbytes // 4, pool.nbytes // 4)
    for layer in (4, -1):
        with pytest.raises(ValueError, match=f"has no layer {layer} \\(it has 4\\)"):
            pool_layer(pool, layer)


def _tensor(shape: tuple[int, ...], dtype: str) -> SimpleNamespace:
    return SimpleNamespace(shape=shape, dtype=np.dtype(dtype))


def test_an_epilogue_checks_its_inputs_and_makes_its_outputs() -> None:
    source = "in x: f32\nin bias: f32[cols]\nparam alpha: f32\nout y = (x + bias) * alpha\n"
    request = KernelRequest("epilogue", "eta", (("source", source), ("params", (("alpha", 2.0),))))
    program = EpilogueProgram(request, "wgsl")
    assert program.params == {"alpha": 2.0}
    made: list[tuple] = []

    def empty(shape: tuple[int, int], dtype: str) -> tuple:
        made.append((shape, dtype))
        return made[-1]

    rows, cols, outputs = program.outputs([_tensor((3, 5), "float32"), _tensor((5,), "float32")], empty)
    assert (rows, cols, outputs) == (3, 5, [((3, 5), "float32")])
    assert program.packed_params(rows, cols) == program.layout.pack_params(3, 5, alpha=2.0)
    with pytest.raises(ValueError, match="epilogue input 'bias' is int32, not float32"):
        program.outputs([_tensor((3, 5), "float32"), _tensor((5,), "int32")], empty)
    with pytest.raises(ValueError, match="'bias' has shape"):
        program.outputs([_tensor((3, 5), "float32"), _tensor((4,), "float32")], empty)


def test_page_ids_are_checked_against_the_pool() -> None:
    ids = checked_page_ids((2, 6, 2, 4, 1, 8), np.array([[5, 0]]), np.int32)
    assert ids.dtype == np.int32 and ids.tolist() == [5, 0] and ids.flags.c_contiguous
    with pytest.raises(ValueError, match=r"page ids must lie in \[0, 6\), got 0\.\.6"):
        checked_page_ids((2, 6, 2, 4, 1, 8), np.array([0, 6]))


def test_a_pass_plan_engine_hands_each_plan_to_its_backend() -> None:
    backend = SimpleNamespace(pass_plan=None)

    class Engine(PassPlanEngine):
        def open_backend(self, device: object) -> SimpleNamespace:  # type: ignore[override]
            return backend

    engine, device, plan = Engine(), SimpleNamespace(index=0), object()
    engine.pie_begin_pass(device, plan)  # type: ignore[arg-type]
    assert backend.pass_plan is plan
    engine.pie_end_pass(device)  # type: ignore[arg-type]
    assert backend.pass_plan is None


def _tensor(shape: tuple[int, ...], dtype: str) -> SimpleNamespace:
    return SimpleNamespace(shape=shape, dtype=dtype)


@pytest.mark.parametrize("spell", [np.dtype, str], ids=["numpy dtype", "dtype name"])
def test_argument_checks_accept_good_tensors_and_name_what_is_wrong_with_bad_ones(spell: object) -> None:
    def t(shape: tuple[int, ...], dtype: str = "float32") -> SimpleNamespace:
        return _tensor(shape, spell(dtype))  # type: ignore[operator]

    check_add(t((2, 8)), t((2, 8)))
    with pytest.raises(ValueError, match=r"add: shapes \(2, 8\) and \(8, 2\) differ"):
        check_add(t((2, 8)), t((8, 2)))

    assert check_silu_mul(t((3, 8))) == (3, 4)
    with pytest.raises(ValueError, match="silu_mul: width 7 is odd"):
        check_silu_mul(t((3, 7)))

    assert check_rope(t((2, 12)), t((2,), "int32"), t((2,)), 4) == (2, 3)
    with pytest.raises(ValueError, match="rope: width 10 is not whole heads of 4"):
        check_rope(t((2, 10)), t((2,), "int32"), t((2,)), 4)
    with pytest.raises(ValueError, match="rope: width 12 is not whole heads of 3"):
        check_rope(t((2, 12)), t((2,), "int32"), t((1,)), 3)
    with pytest.raises(ValueError, match="rope: width 12 is not whole heads of 0"):
        check_rope(t((2, 12)), t((2,), "int32"), t((0,)), 0)
    with pytest.raises(ValueError, match=r"rope: positions must be int32 \[2\]"):
        check_rope(t((2, 12)), t((3,), "int32"), t((2,)), 4)
    with pytest.raises(ValueError, match=r"rope: positions must be int32 \[2\]"):
        check_rope(t((2, 12)), t((2,), "int64"), t((2,)), 4)
    with pytest.raises(ValueError, match=r"rope: inv_freq must be \[2\], got \(4,\)"):
        check_rope(t((2, 12)), t((2,), "int32"), t((4,)), 4)

    check_append_kv(t((3, 16)), t((3, 16)), t((3,), "int32"), 16)
    with pytest.raises(ValueError, match=r"append_kv: k \(3, 16\), v \(2, 16\), slots \(3,\)"):
        check_append_kv(t((3, 16)), t((2, 16)), t((3,), "int32"), 16)
    with pytest.raises(ValueError, match=r"are not \[tokens, 16\] and \[tokens\]"):
        check_append_kv(t((3, 8)), t((3, 8)), t((3,), "int32"), 16)
    with pytest.raises(ValueError, match=r"are not \[tokens, 16\]"):
        check_append_kv(t((3, 16)), t((3, 16)), t((4,), "int32"), 16)
    with pytest.raises(ValueError, match="append_kv: slots must be int32, not int64"):
        check_append_kv(t((3, 16)), t((3, 16)), t((3,), "int64"), 16)

    assert check_indices("gather_rows", t((5,), "int32")) == 5
    with pytest.raises(ValueError, match=r"gather_rows: indices must be int32 \[n\]"):
        check_indices("gather_rows", t((5,), "float32"))
    with pytest.raises(ValueError, match=r"gather_rows: indices must be int32 \[n\]"):
        check_indices("gather_rows", t((5, 1), "int32"))

    check_residual("linear_add", None, 2, 4)
    check_residual("linear_add", t((2, 4)), 2, 4)
    with pytest.raises(ValueError, match=r"linear_add: residual \(4, 2\) mismatches the output \(2, 4\)"):
        check_residual("linear_add", t((4, 2)), 2, 4)

    check_norm_weight("rms_norm", t((8,)), 8)
    with pytest.raises(ValueError, match=r"rms_norm: weight \(4,\) is not \[8\]"):
        check_norm_weight("rms_norm", t((4,)), 8)
    with pytest.raises(ValueError, match=r"rms_norm_heads: weight None is not \[8\]"):
        check_norm_weight("rms_norm_heads", None, 8)

    def tables(*lengths: int, dtype: str = "int32") -> list[SimpleNamespace]:
        return [t((n,), dtype) for n in lengths]

    assert check_page_tables(*tables(3, 5, 3, 2)) == 2
    with pytest.raises(ValueError, match="attention: page tables must be int32 vectors"):
        check_page_tables(*tables(3, 5, 3, 2, dtype="int64"))
    with pytest.raises(ValueError, match="attention: page tables must be int32 vectors"):
        check_page_tables(t((3, 1), "int32"), *tables(5, 3, 2))
    with pytest.raises(ValueError, match="kv_page_indptr and qo_indptr describe different batches"):
        check_page_tables(*tables(3, 5, 2, 2))
    with pytest.raises(ValueError, match="kv_last_page_lens does not match the batch"):
        check_page_tables(*tables(3, 5, 3, 3))

    check_bias_and_norm("linear", None, None, 6, 4)
    check_bias_and_norm("rms_norm_linear", t((6,)), t((4,)), 6, 4)
    with pytest.raises(ValueError, match=r"linear: bias \(5,\) for 6 rows"):
        check_bias_and_norm("linear", t((5,)), None, 6, 4)
    with pytest.raises(ValueError, match=r"rms_norm_linear: norm weight \(6,\) for 4 columns"):
        check_bias_and_norm("rms_norm_linear", None, t((6,)), 6, 4)
