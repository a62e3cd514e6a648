"""The host side of catalogue kernels the device engines share (pie.enginekit.catalogue)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pie.contract import KernelRequest
from pie.enginekit.catalogue import (
    AttentionOptions,
    EpilogueProgram,
    attention_request,
    argument_check,
    check_add,
    check_append_kv,
    check_attention,
    check_indices,
    check_norm_weight,
    check_page_tables,
    check_projection,
    check_rope,
    check_silu_mul,
    check_slice_columns,
    check_top_k,
    checked_launcher,
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
    assert pool_layer("attention", pool, 0) == (0, pool.nbytes // 4)
    assert pool_layer("attention", pool, 3) == (3 * pool.nbytes // 4, pool.nbytes // 4)
    for layer in (4, -1):
        with pytest.raises(ValueError, match=f"append_kv: the page pool .* has no layer {layer} \\(it has 4\\)"):
            pool_layer("append_kv", pool, layer)


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
    with pytest.raises(ValueError, match=r"rope: positions \(3,\) are not \[2\]"):
        check_rope(t((2, 12)), t((3,), "int32"), t((2,)), 4)
    with pytest.raises(ValueError, match=r"rope positions: expected a 1-d int32 tensor, got \(2,\) int64"):
        check_rope(t((2, 12)), t((2,), "int64"), t((2,)), 4)
    with pytest.raises(ValueError, match=r"rope x: expected a 2-d float32 tensor, got \(2, 12\) float16"):
        check_rope(t((2, 12), "float16"), t((2,), "int32"), t((2,)), 4)
    with pytest.raises(ValueError, match=r"rope: inv_freq must be \[2\], got \(4,\)"):
        check_rope(t((2, 12)), t((2,), "int32"), t((4,)), 4)

    assert check_add(t((2, 8)), t((2, 8))) is None
    with pytest.raises(ValueError, match=r"add b: expected a 2-d float32 tensor, got \(2, 8\) bfloat16"):
        check_add(t((2, 8)), SimpleNamespace(shape=(2, 8), dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"add a: expected a 2-d float32 tensor, got \(16,\) float32"):
        check_add(t((16,)), t((16,)))
    with pytest.raises(ValueError, match="add a: expected a 2-d float32 tensor, got None"):
        check_add(None, t((2, 8)))

    assert check_slice_columns(t((3, 8)), 2, 8) == 3
    with pytest.raises(ValueError, match=r"slice_columns: \[2:9\] is outside 8 columns"):
        check_slice_columns(t((3, 8)), 2, 9)
    assert check_top_k(t((3, 8)), 8) == (3, 8)
    with pytest.raises(ValueError, match=r"top_k: k=9 must be in 1\.\.8"):
        check_top_k(t((3, 8)), 9)

    pool = t((2, 6, 2, 4, 2, 8))  # 2 KV heads of 8: rows of 16
    assert check_append_kv(pool, t((3, 16)), t((3, 16)), t((3,), "int32")) == 3
    with pytest.raises(ValueError, match=r"append_kv: k \(3, 16\), v \(2, 16\), slots \(3,\)"):
        check_append_kv(pool, t((3, 16)), t((2, 16)), t((3,), "int32"))
    with pytest.raises(ValueError, match=r"are not \[tokens, 16\] and \[tokens\]"):
        check_append_kv(pool, t((3, 8)), t((3, 8)), t((3,), "int32"))
    with pytest.raises(ValueError, match=r"are not \[tokens, 16\]"):
        check_append_kv(pool, t((3, 16)), t((3, 16)), t((4,), "int32"))
    with pytest.raises(ValueError, match=r"append_kv slots: expected a 1-d int32 tensor, got \(3,\) int64"):
        check_append_kv(pool, t((3, 16)), t((3, 16)), t((3,), "int64"))
    with pytest.raises(ValueError, match=r"append_kv v: expected a 2-d float32 tensor, got \(3, 16\) float16"):
        check_append_kv(pool, t((3, 16)), t((3, 16), "float16"), t((3,), "int32"))
    with pytest.raises(ValueError, match=r"append_kv: \(6, 2, 4, 2, 8\) is not a page pool"):
        check_append_kv(t((6, 2, 4, 2, 8)), t((3, 16)), t((3, 16)), t((3,), "int32"))

    assert check_attention(t((5, 32)), pool, 4) == 5
    with pytest.raises(ValueError, match=r"attention: q \(5, 24\) is not \[tokens, 3 heads \* 8\] over 2 KV heads"):
        check_attention(t((5, 24)), pool, 3)
    with pytest.raises(ValueError, match=r"attention: q \(5, 16\) is not \[tokens, 4 heads \* 8\]"):
        check_attention(t((5, 16)), pool, 4)

    assert check_indices("gather_rows", t((5,), "int32")) == 5
    with pytest.raises(ValueError, match=r"gather_rows indices: expected a 1-d int32 tensor, got \(5,\) float32"):
        check_indices("gather_rows", t((5,), "float32"))
    with pytest.raises(ValueError, match=r"gather_rows indices: expected a 1-d int32 tensor, got \(5, 1\) int32"):
        check_indices("gather_rows", t((5, 1), "int32"))

    check_norm_weight("rms_norm", t((8,)), 8)
    with pytest.raises(ValueError, match=r"rms_norm: weight \(4,\) is not \[8\]"):
        check_norm_weight("rms_norm", t((4,)), 8)
    with pytest.raises(ValueError, match=r"rms_norm_heads: weight None is not \[8\]"):
        check_norm_weight("rms_norm_heads", None, 8)
    with pytest.raises(ValueError, match=r"rms_norm weight: expected a 1-d float32 tensor, got \(8,\) int32"):
        check_norm_weight("rms_norm", t((8,), "int32"), 8)

    def tables(*lengths: int, dtype: str = "int32") -> list[SimpleNamespace]:
        return [t((n,), dtype) for n in lengths]

    assert check_page_tables(*tables(3, 5, 3, 2)) == 2
    with pytest.raises(ValueError, match=r"attention qo_indptr: expected a 1-d int32 tensor, got \(3,\) int64"):
        check_page_tables(*tables(3, 5, 3, 2, dtype="int64"))
    with pytest.raises(ValueError, match=r"attention qo_indptr: expected a 1-d int32 tensor, got \(3, 1\)"):
        check_page_tables(t((3, 1), "int32"), *tables(5, 3, 2))
    with pytest.raises(ValueError, match="kv_page_indptr and qo_indptr describe different batches"):
        check_page_tables(*tables(3, 5, 2, 2))
    with pytest.raises(ValueError, match="kv_last_page_lens does not match the batch"):
        check_page_tables(*tables(3, 5, 3, 3))


@pytest.mark.parametrize("spell", [np.dtype, str], ids=["numpy dtype", "dtype name"])
def test_a_projection_takes_a_weight_of_any_type_by_its_shape_and_checks_what_it_adds(spell: object) -> None:
    def t(shape: tuple[int, ...], dtype: str = "float32") -> SimpleNamespace:
        return _tensor(shape, spell(dtype))  # type: ignore[operator]

    stored = SimpleNamespace(shape=(6, 4), type="q4_1")  # a weight in its stored type: no float dtype
    assert check_projection("linear", t((2, 4)), stored, t((6,)), None, None) == (2, 4, 6)
    assert check_projection("rms_norm_linear", t((2, 4)), t((6, 4)), None, None, t((4,))) == (2, 4, 6)
    assert check_projection("linear_add", t((2, 4)), t((6, 4)), None, t((2, 6)), None) == (2, 4, 6)
    assert check_projection("rms_norm_gate_up_silu", t((2, 4)), t((6, 4)), None, None, t((4,))) == (2, 4, 3)
    with pytest.raises(ValueError, match=r"linear: x \(2, 5\) has 5 columns, the weight \(6, 4\) takes 4"):
        check_projection("linear", t((2, 5)), stored, None, None, None)
    with pytest.raises(ValueError, match=r"rms_norm_gate_up_silu: the stacked gate/up weight has an odd number of rows \(5\)"):
        check_projection("rms_norm_gate_up_silu", t((2, 4)), t((5, 4)), None, None, t((4,)))
    with pytest.raises(ValueError, match=r"linear: bias \(5,\) for 6 rows"):
        check_projection("linear", t((2, 4)), stored, t((5,)), None, None)
    with pytest.raises(ValueError, match=r"rms_norm_linear: norm weight \(6,\) for 4 columns"):
        check_projection("rms_norm_linear", t((2, 4)), stored, None, None, t((6,)))
    with pytest.raises(ValueError, match=r"linear_add: residual \(6, 2\) mismatches the output \(2, 6\)"):
        check_projection("linear_add", t((2, 4)), stored, None, t((6, 2)), None)
    with pytest.raises(ValueError, match=r"linear_add residual: expected a 2-d float32 tensor, got \(2, 6\) float16"):
        check_projection("linear_add", t((2, 4)), stored, None, t((2, 6), "float16"), None)
    with pytest.raises(ValueError, match=r"linear x: expected a 2-d float32 tensor, got \(2, 4\) int32"):
        check_projection("linear", t((2, 4), "int32"), stored, None, None, None)


def test_one_launch_check_per_kernel_takes_the_catalogue_arguments_in_order() -> None:
    def t(shape: tuple[int, ...], dtype: str = "float32") -> SimpleNamespace:
        return _tensor(shape, dtype)

    def check(name: str, **options: object) -> object:
        checker = argument_check(_request(name, **options))
        assert checker is not None, name
        return checker

    check("rms_norm_linear")(t((2, 4)), t((4,)), t((6, 4)))  # x, norm weight, weight: the catalogue's order
    with pytest.raises(ValueError, match=r"rms_norm_linear: norm weight \(6,\) for 4 columns"):
        check("rms_norm_linear")(t((2, 4)), t((6,)), t((6, 4)), None)
    with pytest.raises(ValueError, match=r"embedding indices: expected a 1-d int32 tensor"):
        check("embedding")(t((3,)), t((50, 4)))
    check("embedding")(t((3,), "int32"), SimpleNamespace(shape=(50, 4), type="q8_0"))
    with pytest.raises(ValueError, match=r"rms_norm_heads: weight \(8,\) is not \[4\]"):
        check("rms_norm_heads", head_dim=4)(t((2, 8)), t((8,)))
    with pytest.raises(ValueError, match="rms_norm_heads: width 8 is not whole heads of 3"):
        check("rms_norm_heads", head_dim=3)(t((2, 8)), t((3,)))
    with pytest.raises(ValueError, match=r"slice_columns: \[1:9\] is outside 8 columns"):
        check("slice_columns", start=1, stop=9)(t((2, 8)))
    with pytest.raises(ValueError, match=r"rope: positions \(1,\) are not \[2\]"):
        check("rope", head_dim=4)(t((2, 8)), t((1,), "int32"), t((2,)))
    with pytest.raises(ValueError, match=r"top_k: k=9"):
        check("top_k", k=9)(t((2, 8)))
    pool, tables = t((1, 4, 2, 4, 2, 8)), [t((n,), "int32") for n in (3, 5, 3, 2)]
    check("attention", layer=0, num_heads=4)(t((5, 32)), pool, *tables)
    with pytest.raises(ValueError, match="kv_last_page_lens does not match the batch"):
        check("attention", layer=0, num_heads=4)(t((5, 32)), pool, *tables[:3], t((3,), "int32"))
    with pytest.raises(ValueError, match=r"append_kv: k \(2, 16\), v \(2, 16\), slots \(3,\)"):
        check("append_kv", layer=0)(pool, t((2, 16)), t((2, 16)), t((3,), "int32"))
    with pytest.raises(ValueError, match=r"argmax x: expected a 2-d float32 tensor, got \(8,\) float32"):
        check("argmax")(t((8,)))


def _request(name: str, **options: Any) -> KernelRequest:
    return KernelRequest(name, None, tuple(sorted(options.items())))


def test_a_checked_launcher_checks_before_it_launches_and_epilogues_go_unwrapped() -> None:
    launched: list[tuple[Any, ...]] = []

    def launcher(*args: Any) -> str:
        launched.append(args)
        return "out"

    add = checked_launcher(_request("add"), launcher)
    a = np.zeros((2, 4), np.float32)
    assert add(a, a) == "out" and len(launched) == 1
    with pytest.raises(ValueError, match=r"add: shapes \(2, 4\) and \(2, 3\) differ"):
        add(a, np.zeros((2, 3), np.float32))
    assert len(launched) == 1 and add.__wrapped__ is launcher  # type: ignore[attr-defined]
    assert argument_check(_request("epilogue", source="")) is None
    assert checked_launcher(_request("epilogue", source=""), launcher) is launcher


def test_rms_norm_heads_names_itself_when_its_heads_do_not_divide_the_width() -> None:
    check = argument_check(_request("rms_norm_heads", eps=1e-6, head_dim=24))
    assert check is not None
    check(np.zeros((3, 48), np.float32), np.ones(24, np.float32))
    with pytest.raises(ValueError, match="rms_norm_heads: width 64 is not whole heads of 24"):
        check(np.zeros((3, 64), np.float32), np.ones(24, np.float32))


@pytest.mark.parametrize("layer", [2, -1])
def test_append_kv_and_attention_refuse_a_layer_the_pool_lacks(layer: int) -> None:
    pool = np.zeros((2, 8, 2, 4, 2, 16), np.float32)
    k, slots = np.zeros((3, 32), np.float32), np.arange(3, dtype=np.int32)
    tables = [np.array(values, np.int32) for values in ([0, 3], [0], [0, 1], [3])]
    for good in (0, 1):
        argument_check(_request("append_kv", layer=good))(pool, k, k, slots)  # type: ignore[misc]
        argument_check(_request("attention", layer=good, num_heads=2, scale=0.25))(k, pool, *tables)  # type: ignore[misc]
    refused = rf"the page pool \(2, 8, 2, 4, 2, 16\) has no layer {layer} \(it has 2\)"
    with pytest.raises(ValueError, match=f"append_kv: {refused}"):
        argument_check(_request("append_kv", layer=layer))(pool, k, k, slots)  # type: ignore[misc]
    with pytest.raises(ValueError, match=f"attention: {refused}"):
        argument_check(_request("attention", layer=layer, num_heads=2, scale=0.25))(k, pool, *tables)  # type: ignore[misc]
