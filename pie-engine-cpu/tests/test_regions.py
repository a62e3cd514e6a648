"""The attention-input region as one native call equals its kernels run one by one."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from pie import kernels as reference
from pie.contract import AttentionRegion, RegionOp, RegionRequest
from pie.testing.regions import attention_input_arguments, described_attention_input_region
from pie_engine_cpu import native
from pie_engine_cpu.regions import compile_region

Q, KV, HEAD_DIM, HIDDEN = 96, 32, 16, 48


def _region(bias: bool, **options: object) -> RegionRequest:
    """The attention-input region with its description, as Poem offers a layer's (``options`` change the layer)."""
    return described_attention_input_region(Q, KV, HEAD_DIM, HIDDEN, bias, **options)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 16, 17, 32, 33, 40])
def test_the_fused_region_equals_its_kernels(tokens: int, bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native.load(), "max_rows", 32)  # read as the region compiles: 33 and 40 rows go to BLAS
    args = attention_input_arguments(Q, KV, HEAD_DIM, HIDDEN, tokens, bias)
    x, ln, w, positions, inv_freq = *args[:3], *args[-2:]
    launcher = compile_region(_region(bias))
    assert launcher is not None
    v, q_rot, k_rot = launcher(*args)
    qkv = reference.linear(reference.rms_norm(x, ln, eps=1e-5), w, args[3] if bias else None)
    expected_q = reference.rope(qkv[:, :Q], positions, inv_freq, head_dim=HEAD_DIM)
    expected_k = reference.rope(np.ascontiguousarray(qkv[:, Q : Q + KV]), positions, inv_freq, head_dim=HEAD_DIM)
    for got, expected in ((q_rot, expected_q), (k_rot, expected_k), (v, qkv[:, Q + KV :])):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_other_regions_are_lowered_kernel_by_kernel() -> None:
    region = _region(False)
    assert compile_region(RegionRequest("L0.attention", region.ops[:2], region.inputs, ("qkv",))) is None
    assert compile_region(replace(region, attention_input=None)) is None, "the same ops without a description"
    assert compile_region(replace(region, outputs=("q_rot", "k_rot"))) is None, "not exactly q, k and v"


def _attention_region(**options: object) -> RegionRequest:
    """append_kv and attention of layer 1 with its description, as Poem offers a layer's (``options`` change
    the layer); the launcher takes ``pool, k, v, slots, q, qo, indices, indptr, last``."""
    layer = replace(_region(False).attention_input.layer, layer=1, num_heads=6, num_kv_heads=2, **options)
    attend_options = (("layer", 1), ("num_heads", 6), ("scale", 0.25), *sorted(options.items()))
    ops = (
        RegionOp("append_kv", ("pool", "k", "v", "slots"), None, (("layer", 1),)),
        RegionOp("attention", ("q", "pool", "qo", "indices", "indptr", "last"), "out", attend_options),
    )
    region = RegionRequest("L1.attention", ops, ("pool", "k", "v", "slots", "q", "qo", "indices", "indptr", "last"), ("out",))
    return replace(region, attention=AttentionRegion(layer, "q", "k", "v", "out"))


@pytest.mark.parametrize("options", [{}, {"window": 6, "softcap": 2.0}], ids=["plain", "window-softcap"])
@pytest.mark.parametrize(("lengths", "new"), [([37, 5, 64], [1, 1, 1]), ([30, 8], [3, 1])], ids=["decode", "prefill"])
def test_append_and_attend_as_one_launch_equals_the_two_kernels(lengths: list[int], new: list[int], options: dict) -> None:
    from pie_engine_cpu import kernels
    from test_native import _paged_batch

    q, pool, qo, indices, indptr, last = _paged_batch(lengths, new, seed=7)
    rng = np.random.default_rng(8)
    k = rng.standard_normal((q.shape[0], 2 * 16), dtype=np.float32)
    v = rng.standard_normal((q.shape[0], 2 * 16), dtype=np.float32)
    slots = np.array([int(indices[indptr[b + 1] - 1]) * 4 + int(last[b]) - 1 - j for b in range(len(new)) for j in reversed(range(new[b]))], np.int32)
    launcher = compile_region(_attention_region(**options))
    assert launcher is not None
    expected_pool = pool.copy()
    kernels.make_append_kv(1)(expected_pool, k, v, slots)
    expected = kernels.make_attention(1, 6, 0.25, **options)(q, expected_pool, qo, indices, indptr, last)
    (got,) = launcher(pool, k, v, slots, q, qo, indices, indptr, last)
    np.testing.assert_array_equal(pool, expected_pool)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_the_attention_region_is_read_from_its_description_not_its_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    region = _attention_region(window=6)
    assert compile_region(replace(region, attention=None)) is None, "the same ops without a description"
    launched: list[tuple[str, tuple]] = []
    monkeypatch.setattr(native, "make_append_kv", lambda layer: lambda *a: launched.append(("append", (layer, a))))
    monkeypatch.setattr(native, "make_attention", lambda *o: lambda *a: launched.append(("attend", (o, a))) or "out")
    reordered = replace(region, inputs=region.inputs[::-1])  # the description names the inputs, wherever they are
    launcher = compile_region(reordered)
    assert launcher is not None
    assert launcher(*(f"value of {name}" for name in reordered.inputs)) == ("out",)
    values = [f"value of {name}" for name in ("pool", "k", "v", "slots", "q", "qo", "indices", "indptr", "last")]
    assert launched == [
        ("append", (1, tuple(values[:4]))),
        ("attend", ((1, 6, 0.25, 6, 0.0), (values[4], values[0], *values[5:]))),
    ]


@pytest.mark.parametrize(
    ("architecture", "fused"), [("llama", True), ("qwen2", True), ("qwen3", True), ("gemma2", True), ("gemma3", True)]
)
def test_a_models_attention_inputs_are_taken_from_their_descriptions(architecture: str, fused: bool) -> None:
    """Poem offers each layer's attention input and attention with their descriptions; the engine takes every
    attention and every attention input (per-head Q/K norms included) as one launch; the model's logits are
    transformers' (``pie-core/tests/runtime/test_against_transformers.py``) and its kernels' (``test_layers``)."""
    from pie.plugins import EngineRegistry
    from pie.runtime.model_runner import ModelRunner
    from pie.testing.models import random_weights, tiny_config

    config = tiny_config(architecture)
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    runner = ModelRunner(config, random_weights(config).items(), device, page_size=4, max_cached_tokens=64)
    whole = {step.region for step in runner.plan.steps if step.whole_region}
    attention_inputs = {f"L{i}.attn_in" for i in range(config.num_layers)}
    assert attention_inputs & whole == (attention_inputs if fused else set()), whole
    assert {f"L{i}.attention" for i in range(config.num_layers)} <= whole, "append_kv and attention: one launch"
    runner.close()
