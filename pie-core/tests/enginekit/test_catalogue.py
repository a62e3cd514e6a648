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
