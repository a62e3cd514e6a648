"""Launches whose row tensors or weights exceed one storage binding, on the shared-kernel engines (Vulkan and wgpu,
here on lavapipe): the launchers run them over rows in turn, and projections and embeddings over chunks of their
weight's rows, bound at offsets. The device's limit is lowered to 4 KiB here, so tensors of a few KiB stand for the
129 MiB of logits that 129 rows of a 262,144-word vocabulary take and for Gemma 3's 640 MiB embedding
(``ConformanceSuite.test_logits_of_more_rows_than_a_storage_binding_holds`` and
``test_a_vocabulary_past_a_storage_binding_is_embedded_and_projected`` run those under the real limit)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pie import kernels
from pie.plugins import Device, EngineRegistry
from pie.runtime.model_runner import SequenceWork
from pie.testing.conformance import TOLERANCE
from pie.testing.model_parity import small_runner
from pie.testing.models import random_weights, tiny_config
from pie.testing.kquants import quantize_k
from pie.weights import StoredWeight, quantize

LIMIT = 4096
ROWS = 50
WEIGHT_COLUMNS = {"f32": 32, "f16": 32, "q8_0": 64, "q4_k": 256, "q6_k": 256}
"""The columns of a weight of each type in these tests: a chunk of its rows that keeps offsets aligned fits 4 KiB
(Q6_K's 210-byte rows in chunks of 16, 3,360 bytes), and every type's 72 rows do not."""
WEIGHT_ROWS = 72


@pytest.fixture(scope="module", params=("vulkan", "wgpu"))
def device(request: pytest.FixtureRequest) -> Device:
    pytest.importorskip(f"pie_engine_{request.param}")
    return EngineRegistry().engine(request.param).open(0)


def _backend(device: Device) -> Any:
    return importlib.import_module(f"pie_engine_{device.name}.plugin").engine.launchers(device.info).backend


@pytest.fixture
def launches(device: Device, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The entry points dispatched, with the device's binding limit lowered to ``LIMIT`` bytes."""
    backend = _backend(device)
    monkeypatch.setattr(backend, "max_binding_bytes", LIMIT)
    dispatch, names = backend.dispatch, []

    def counted(entry: Any, *args: Any) -> None:
        names.append(entry.name)
        dispatch(entry, *args)

    monkeypatch.setattr(backend, "dispatch", counted)
    return names


def _f32(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


def _on(device: Device, launches: list[str], launcher: Callable[..., Any], *arrays: np.ndarray) -> Any:
    """What ``launcher`` gives for ``arrays``, checked to have run in more than one launch."""
    uploaded = [device.upload(array) for array in arrays]
    before = len(launches)
    got = launcher(*uploaded)
    assert len(launches) - before > 1, f"{launches[-1]} ran in one launch"
    return tuple(map(device.download, got)) if isinstance(got, tuple) else device.download(got)


def test_projections_run_over_token_rows_past_one_binding(device: Device, launches: list[str]) -> None:
    """x is 50 rows of 144 bytes (7,200 bytes): not a multiple of the offset alignment a row."""
    x, norm, residual = _f32(ROWS, 36), _f32(36) + 1, _f32(ROWS, 24)
    weight, gate_up = _f32(24, 36), _f32(24, 36) + 0.5  # within the limit: weights are bound whole
    for variant in device.kernels()["linear"]:
        got = _on(device, launches, device.compile("linear", variant), x, weight)
        np.testing.assert_allclose(got, kernels.linear(x, weight), **TOLERANCE, err_msg=f"linear[{variant}]")
    cases = {
        "linear_add": ((x, weight, residual), kernels.linear_add(x, weight, residual)),
        "rms_norm_linear": ((x, norm, weight), kernels.linear(kernels.rms_norm(x, norm, eps=1e-6), weight)),
        "rms_norm_gate_up_silu": ((x, norm, gate_up), kernels.rms_norm_gate_up_silu(x, norm, gate_up, eps=1e-6)),
    }
    for name, (arrays, expected) in cases.items():
        options = {} if name == "linear_add" else {"eps": 1e-6}
        got = _on(device, launches, device.compile(name, **options), *arrays)
        np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=name)


def test_row_kernels_run_over_rows_past_one_binding(device: Device, launches: list[str]) -> None:
    x, gate_up, weight = _f32(ROWS, 36), _f32(ROWS, 72), _f32(36) + 1
    cases: dict[str, tuple[dict[str, Any], tuple[np.ndarray, ...]]] = {
        "rms_norm": ({"eps": 1e-6}, (x, weight)),
        "add": ({}, (x, x[::-1].copy())),
        "silu_mul": ({}, (gate_up,)),
        "slice_columns": ({"start": 7, "stop": 43}, (gate_up,)),
        "softmax": ({"temperature": 0.5}, (x,)),
        "argmax": ({}, (x,)),
        "top_k": ({"k": 4}, (x,)),
    }
    for name, (options, arrays) in cases.items():
        got = _on(device, launches, device.compile(name, **options), *arrays)
        expected = kernels.REFERENCE[name](*arrays, **options)
        for part, want in zip(got if name == "top_k" else (got,), expected if name == "top_k" else (expected,)):
            np.testing.assert_allclose(part, want, **TOLERANCE, err_msg=name)


def test_epilogues_run_over_rows_past_one_binding_and_bind_a_column_input_whole(
    device: Device, launches: list[str]
) -> None:
    """A final logit softcap (Gemma 2's 256,000 words) or a user's logit epilogue runs on rows of logits."""
    if not device.supports("epilogue"):
        pytest.skip(f"{device.name} compiles no epilogue here")
    from pie.eta.stdlib import SOURCES

    x, weight = _f32(ROWS, 36), _f32(36) + 1
    cases = {"rms_norm": ((x, weight), (("eps", 1e-6),)), "bias_add": ((x, weight), ()), "softmax": ((x,), ())}
    for name, (arrays, params) in cases.items():
        got = _on(device, launches, device.compile("epilogue", source=SOURCES[name], params=params), *arrays)
        expected = kernels.epilogue(*arrays, source=SOURCES[name], params=params)
        np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=name)


def _weight(weight_type: str, rows: int, columns: int) -> tuple[np.ndarray | StoredWeight, np.ndarray]:
    """A weight of ``weight_type`` larger than ``LIMIT``, and its float32 values."""
    values = _f32(rows, columns)
    weight = quantize_k(values, weight_type) if weight_type.endswith("_k") else quantize(values, weight_type)
    exact = weight.dequantize() if isinstance(weight, StoredWeight) else weight
    return weight, exact


@pytest.mark.parametrize("weight_type", WEIGHT_COLUMNS)
def test_projections_run_over_chunks_of_a_weight_past_one_binding(
    device: Device, launches: list[str], weight_type: str
) -> None:
    """A weight of 72 rows (output columns) is several launches' chunks, each bound at an aligned offset, its output
    and residual bound at the chunk's first column with 72 columns a row; its 50 token rows are past the limit too.
    Every kernel bound the weight whole: a weight past a binding (Gemma 3's embedding, the tied head) was refused."""
    k = WEIGHT_COLUMNS[weight_type]
    weight, exact = _weight(weight_type, WEIGHT_ROWS, k)
    x, norm, bias, residual = _f32(ROWS, k), _f32(k) + 1, _f32(WEIGHT_ROWS), _f32(ROWS, WEIGHT_ROWS)
    [uploaded] = device.upload_weights([weight])
    nbytes = uploaded.words.nbytes if weight_type != "f32" else uploaded.nbytes
    assert nbytes > LIMIT and ROWS * WEIGHT_ROWS * 4 > LIMIT
    cases: dict[str, tuple[dict[str, Any], Callable[[Any], tuple[Any, ...]], np.ndarray]] = {
        "linear": ({}, lambda w: (x, w, bias), kernels.linear(x, exact, bias)),
        "rms_norm_linear": (
            {"eps": 1e-6}, lambda w: (x, norm, w, bias), kernels.rms_norm_linear(x, norm, exact, bias, eps=1e-6)
        ),
        "linear_add": ({}, lambda w: (x, w, residual), kernels.linear_add(x, exact, residual)),
    }
    for name, (options, arguments, expected) in cases.items():
        for variant in device.kernels()[name]:
            launcher = device.compile(name, variant, **options)
            inputs = [uploaded if argument is weight else device.upload(argument) for argument in arguments(weight)]
            before = len(launches)
            got = device.download(launcher(*inputs))
            assert len(launches) - before > 1, f"{name}[{variant}] ran in one launch"
            np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=f"{name}[{variant}] of {weight_type}")


@pytest.mark.parametrize("weight_type", WEIGHT_COLUMNS)
def test_embeddings_run_over_chunks_of_a_table_past_one_binding(
    device: Device, launches: list[str], weight_type: str
) -> None:
    """Each launch writes the rows whose index its chunk of the table holds, and the first the zeros of indices
    outside the table; 50 rows of output of the narrower tables are past the limit too (not 50 rows of 256 columns:
    the 8 rows that keep 4-byte indices at wgpu's offset alignment of 32 bytes take 8 KiB)."""
    k = WEIGHT_COLUMNS[weight_type]
    table, exact = _weight(weight_type, WEIGHT_ROWS, k)
    ids = np.random.default_rng(7).integers(0, WEIGHT_ROWS, min(ROWS, LIMIT // (4 * k))).astype(np.int32)
    ids[:4] = (WEIGHT_ROWS - 1, -1, WEIGHT_ROWS, 0)  # the last chunk's last row, outside the table, the first row
    expected = np.where(((ids >= 0) & (ids < WEIGHT_ROWS))[:, None], exact[np.clip(ids, 0, WEIGHT_ROWS - 1)], 0)
    [uploaded] = device.upload_weights([table])
    before = len(launches)
    got = device.download(device.compile("embedding")(device.upload(ids), uploaded))
    assert len(launches) - before > 1, "embedding ran in one launch"
    np.testing.assert_array_equal(got, expected.astype(np.float32), err_msg=f"embedding of {weight_type}")


@pytest.mark.parametrize("weight_type", ["f32", "q8_0"])
def test_a_gate_up_weight_past_one_binding_runs_as_a_norm_projection_then_silu_mul(
    device: Device, launches: list[str], weight_type: str
) -> None:
    """rms_norm_gate_up_silu reads a column's up row ``outputs`` rows after its gate row, so no chunk of rows holds
    both: past a binding it runs rms_norm_linear over every row (in chunks) and silu_mul of the halves. It was refused
    when it ran (Llama 3.2 3B's 192 MiB of float32 gate/up, 8B's 224 MiB of float16)."""
    k = WEIGHT_COLUMNS[weight_type]
    gate_up, exact = _weight(weight_type, 2 * WEIGHT_ROWS, k)
    x, norm = _f32(4, k), _f32(k) + 1
    [uploaded] = device.upload_weights([gate_up])
    for variant in device.kernels()["rms_norm_gate_up_silu"]:
        launcher = device.compile("rms_norm_gate_up_silu", variant, eps=1e-6)
        before = len(launches)
        got = device.download(launcher(device.upload(x), device.upload(norm), uploaded))
        ran = launches[before:]
        assert ran.count("silu_mul") == 1 and len(ran) > 2, ran
        expected = kernels.rms_norm_gate_up_silu(x, norm, exact, eps=1e-6)
        np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=f"[{variant}] of {weight_type}")


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_model_whose_vocabulary_is_past_one_binding_gives_the_cpu_engines_logits(
    device: Device, monkeypatch: pytest.MonkeyPatch, architecture: str
) -> None:
    """A vocabulary of 4,000 words under a binding limit of 96 KiB, every other weight within it (the 64 KiB stacked
    gate/up weight the largest): the embedding and the head (Llama's own, Gemma 3's the tied embedding in Q8_0, as
    its GGUF stores it) are 1,000 KiB, and a prefill's 17 rows of logits 266 KiB. Gemma 3 270M's 262,144-word
    embedding is 640 MiB of float32 or 170 MiB of Q8_0, and lavapipe and WebGPU bind 128 MiB: it was refused."""
    monkeypatch.setattr(_backend(device), "max_binding_bytes", 96 << 10)
    tied = architecture == "gemma3"
    config = tiny_config(architecture, vocab_size=4000, tie_word_embeddings=tied)
    tensors = [(name, quantize(weight, "q8_0") if tied and "embed_tokens" in name else weight)
               for name, weight in random_weights(config, seed=3).items()]
    registry = EngineRegistry()
    cpu, other = small_runner(registry.engine("cpu").open(0), config, tensors), small_runner(device, config, tensors)
    prompts = [[int(t) for t in np.random.default_rng(7).integers(0, config.vocab_size, n)] for n in (11, 6)]
    cpu_seqs, seqs = [cpu.new_sequence() for _ in prompts], [other.new_sequence() for _ in prompts]
    expected = cpu.step([SequenceWork(s, p, all_logits=True) for s, p in zip(cpu_seqs, prompts, strict=True)])
    got = other.step([SequenceWork(s, p, all_logits=True) for s, p in zip(seqs, prompts, strict=True)])
    assert got.shape == (17, 4000)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4, err_msg="prefill")
    tokens = [int(np.argmax(expected[last])) for last in (10, 16)]  # each prompt's last token's
    expected = cpu.step([SequenceWork(s, [t]) for s, t in zip(cpu_seqs, tokens, strict=True)])
    got = other.step([SequenceWork(s, [t]) for s, t in zip(seqs, tokens, strict=True)])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4, err_msg="decode")
    other.close()
