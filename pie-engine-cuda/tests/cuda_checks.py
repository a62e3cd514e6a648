"""Checks beyond the conformance kit, run on the host emulator here and on a real GPU where there
is one: 16-bit weights, odd shapes, long contexts, every attention variant, a small model."""

from __future__ import annotations

import numpy as np
from pie import kernels
from pie.contract import PageLayout
from pie.plugins import Device, EngineRegistry
from pie.testing.conformance import TOLERANCE, plan_of_batch, random_batch
from pie_engine_cuda import plugin
from pie_engine_cuda.attention_plan import SPLIT_CHUNK
from pie.testing.kquants import K_TYPES, quantize_k
from pie.weights import StoredWeight, quantize

PROJECTIONS = ("linear", "rms_norm_linear", "linear_add", "rms_norm_gate_up_silu")
ATTENTION_SHAPES = ((64, 6, 2), (128, 2, 1), (40, 3, 3))  # (head_dim, heads, kv_heads)
BATCH_KEYS = ("qo_indptr", "kv_page_indices", "kv_page_indptr", "kv_last_page_lens")


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, round to nearest even (what the device conversion does)."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return rounded.view(np.float32)


def _projection_case(name: str, rng: np.random.Generator, tokens: int, k: int, n: int) -> tuple[tuple, dict, int]:
    """Host inputs, options and the index of the weight among them."""
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    if name == "linear":
        return (x, w, bias), {}, 1
    if name == "rms_norm_linear":
        return (x, norm, w, bias), {"eps": 1e-5}, 2
    if name == "linear_add":
        return (x, w, rng.standard_normal((tokens, n)).astype(np.float32)), {}, 1
    return (x, norm, w), {"eps": 1e-5}, 2


def check_projection_with_16_bit_weights(device: Device, name: str, weights: str) -> None:
    from pie_engine_cuda.plugin import engine

    rng = np.random.default_rng(len(name) + len(weights))
    for tokens, k, n in ((3, 64, 80), (70, 37, 66)):  # k = 37: the scalar path; 70 rows: two row tiles
        inputs, options, wi = _projection_case(name, rng, tokens, k, n)
        rounded = inputs[wi].astype(np.float16).astype(np.float32) if weights == "float16" else bf16_round(inputs[wi])
        expected = kernels.REFERENCE[name](*inputs[:wi], rounded, *inputs[wi + 1 :], **options)
        for variant in device.kernels()[name]:
            uploaded = [device.upload(a) for a in inputs]
            if weights == "float16":
                uploaded[wi] = device.upload(inputs[wi].astype(np.float16))
            else:
                engine.backend(device.info).convert_weight(uploaded[wi], "bfloat16")
                assert uploaded[wi].dtype == "bfloat16"
            got = device.download(device.compile(name, variant, **options)(*uploaded))
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"{name}[{variant}] {tokens}x{k}x{n}")


STORED_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k")
STORED_SHAPES = ((1, 64, 33), (3, 320, 35), (19, 96, 67))
"""(tokens, k, n): batch 1 and more, an odd number of weight rows (out columns when paired), k of
two to ten 32-weight blocks (more than a warp's 256-weight sweep), 19 rows past the gemv limit."""
K_SHAPES = ((1, 256, 33), (3, 768, 35), (19, 512, 67))
"""The same for the K-quants, whose rows are whole super-blocks of 256."""


def _stored(array: np.ndarray, weight_type: str) -> StoredWeight:
    """``array`` in ``weight_type``; the ``gguf`` library writes no K-quant, ``pie.testing.kquants`` does."""
    stored = quantize_k(array, weight_type) if weight_type in K_TYPES else quantize(array, weight_type)
    assert isinstance(stored, StoredWeight)
    return stored


def check_projection_with_stored_weights(device: Device, name: str, weight_type: str) -> None:
    """Every variant of a projection on a weight uploaded as stored (``pie.weights.quantize``, GGML's
    layout) against the reference on its ``gguf.quants`` dequantization, in float32 accumulation."""
    assert weight_type in device.weight_types()[name]
    rng = np.random.default_rng(len(name) + len(weight_type))
    for tokens, k, n in K_SHAPES if weight_type in K_TYPES else STORED_SHAPES:
        n = 2 * n if name == "rms_norm_gate_up_silu" else n
        inputs, options, wi = _projection_case(name, rng, tokens, k, n)
        stored = _stored(inputs[wi], weight_type)
        dequantized = stored.dequantize()
        expected = kernels.REFERENCE[name](*inputs[:wi], dequantized, *inputs[wi + 1 :], **options)
        for variant in device.kernels()[name]:
            uploaded = [device.upload(a) for a in inputs]
            uploaded[wi] = device.upload_weights([stored])[0]
            got = device.download(device.compile(name, variant, **options)(*uploaded))
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name}[{variant}] {weight_type} {tokens}x{k}x{n}")


def check_embedding_of_a_stored_table(device: Device, weight_type: str) -> None:
    """Rows of a table uploaded as stored, dequantized as ``gguf.quants`` does; the device keeps the
    stored values (a block type downloads as its stored bytes, a 16-bit one as its values)."""
    from pie_engine_cuda.runtime import BLOCK_DTYPES

    rng = np.random.default_rng(7)
    stored = _stored(rng.standard_normal((51, 256)).astype(np.float32), weight_type)
    table = device.upload_weights([stored])[0]
    kept = device.download(table)
    if weight_type in BLOCK_DTYPES:
        np.testing.assert_array_equal(kept, stored.data)
    else:
        np.testing.assert_array_equal(kept.astype(np.float32), stored.dequantize())
    ids = np.array([3, 50, 0, 3, 17], np.int32)
    embed = device.compile("embedding")
    got = device.download(embed(device.upload(ids), table))
    np.testing.assert_allclose(got, stored.dequantize()[ids], rtol=1e-6, atol=1e-7)
    bad = device.download(embed(device.upload(np.array([51, -1], np.int32)), table))
    assert np.isnan(bad).all(), "ids outside the table read as NaN"


def check_stored_model_against_its_float32_copy_on_the_cpu_engine(device: Device, path: str,
                                                                  weight_types: tuple[str, ...], steps: int = 4) -> None:
    """A random GGUF model whose matrices are ``weight_types``: uploaded as stored here, its dequantized
    float32 copy on the CPU engine; prefill and greedy decode give close logits and the same tokens."""
    from pie.model import load_model
    from pie.runtime.model_runner import ModelRunner, SequenceWork

    loaded = load_model(path)
    cpu = EngineRegistry(env={}).engine("cpu").open(0)
    dense = ModelRunner(loaded.config, loaded.tensors(), cpu, page_size=4, max_cached_tokens=128)
    stored = ModelRunner(loaded.config, loaded.stored_tensors(), device, page_size=4, max_cached_tokens=128)
    runners = (dense, stored)
    try:
        kept = {c.uploaded for c in stored.weight_choices.values() if not c.converted}
        assert set(weight_types) <= kept and not any(c.converted for c in stored.weight_choices.values())
        prompt = [int(t) for t in np.random.default_rng(0).integers(3, loaded.config.vocab_size, 11)]
        sequences = [runner.new_sequence() for runner in runners]
        logits = [runner.step([SequenceWork(seq, prompt)])[0] for runner, seq in zip(runners, sequences)]
        for step in range(steps):
            scale = np.abs(logits[0]).max()
            np.testing.assert_allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4 * scale, err_msg=f"step {step}")
            token = int(np.argmax(logits[0]))
            assert int(np.argmax(logits[1])) == token, f"step {step}"
            logits = [runner.step([SequenceWork(seq, [token])])[0] for runner, seq in zip(runners, sequences)]
    finally:
        for runner in runners:
            runner.close()


def check_tensor_core_projections_split_along_k(device: Device, multiprocessors: int = 8) -> None:
    """Grids of a few tiles split along k, each tile's blocks meeting in the last to arrive: every
    projection against the reference, with a partial last row tile and a k that ends mid-step, twice
    in a row (the arrival counters must be back at zero), on a device of ``multiprocessors``."""
    from dataclasses import replace

    from pie.contract import KernelRequest
    from pie_engine_cuda import launch as configs
    from pie_engine_cuda.launchers import KERNELS
    from pie_engine_cuda.plugin import engine

    rt = engine.backend(device.info)
    facts = rt.facts
    rt.facts = replace(facts, multiprocessors=multiprocessors)
    try:
        rng = np.random.default_rng(11)
        for name in PROJECTIONS:
            for tokens, k, n in ((20, 300, 80), (70, 200, 64)):
                out_cols = n // 2 if name == "rms_norm_gate_up_silu" else n
                config = configs.gemm(out_cols, tokens, name == "rms_norm_gate_up_silu", True)
                splits = configs.gemm_splits(config.grid_x * config.grid_y, k, multiprocessors)
                assert splits > 1, (name, tokens, k, n)
                inputs, options, _ = _projection_case(name, rng, tokens, k, n)
                expected = kernels.REFERENCE[name](*inputs, **options)
                launch = KERNELS[name][1](rt, KernelRequest(name, "tc", tuple(sorted(options.items()))))  # unshared plans
                for attempt in range(2):
                    got = device.download(launch(*[device.upload(a) for a in inputs]))
                    np.testing.assert_allclose(
                        got, expected, **TOLERANCE, err_msg=f"{name}[tc] {tokens}x{k}x{n}, {splits} splits, call {attempt}"
                    )
    finally:
        rt.facts = facts


def check_embedding_of_a_half_table(device: Device) -> None:
    rng = np.random.default_rng(5)
    table = rng.standard_normal((50, 24)).astype(np.float16)
    ids = np.array([3, 49, 0, 3], np.int32)
    embed = device.compile("embedding")
    got = device.download(embed(device.upload(ids), device.upload(table)))
    np.testing.assert_array_equal(got, table.astype(np.float32)[ids])
    bad = device.download(embed(device.upload(np.array([50, -1], np.int32)), device.upload(table)))
    assert np.isnan(bad).all(), "ids outside the table read as NaN"


def _paged_batch(rng: np.random.Generator, layout: PageLayout, kv_lens: list[int], q_lens: list[int]) -> dict:
    pages = rng.permutation(layout.num_pages)
    qo, indices, indptr, last, used = [0], [], [0], [], 0
    for kv_len, q_len in zip(kv_lens, q_lens):
        count = -(-kv_len // layout.page_size)
        indices.extend(pages[used : used + count])
        used += count
        indptr.append(len(indices))
        last.append(kv_len - (count - 1) * layout.page_size)
        qo.append(qo[-1] + q_len)
    return {key: np.asarray(value, np.int32) for key, value in zip(BATCH_KEYS, (qo, indices, indptr, last))}


def check_attention_on_long_contexts(device: Device, head_dim: int, heads: int, kv_heads: int) -> None:
    """A 600-key decode (several split-KV chunks), a 40-token prefill (several tiles), a short one."""
    rng = np.random.default_rng(head_dim)
    layout = PageLayout(num_layers=2, num_pages=80, page_size=16, num_kv_heads=kv_heads, head_dim=head_dim)
    host_pool = rng.standard_normal(layout.shape).astype(np.float32)
    batch = _paged_batch(rng, layout, kv_lens=[600, 45, 3], q_lens=[1, 40, 3])
    q = rng.standard_normal((int(batch["qo_indptr"][-1]), heads * head_dim)).astype(np.float32)
    scale = head_dim**-0.5
    expected = kernels.attention(q, host_pool, **batch, layer=1, num_heads=heads, scale=scale)
    pool = device.allocate_pages(layout)
    try:
        device.write_pages(pool, np.arange(layout.num_pages), host_pool)
        uploaded = [device.upload(batch[key]) for key in BATCH_KEYS]
        for variant in device.kernels()["attention"]:
            attend = device.compile("attention", variant, layer=1, num_heads=heads, scale=scale)
            got = device.download(attend(device.upload(q), pool, *uploaded))
            np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=f"attention[{variant}]")
    finally:
        device.free_pages(pool)


def check_split_kv_attention_splits_a_long_decode_once(device: Device) -> None:
    rng = np.random.default_rng(3)
    layout = PageLayout(num_layers=1, num_pages=70, page_size=16, num_kv_heads=1, head_dim=32)
    host_pool = rng.standard_normal(layout.shape).astype(np.float32)
    batch = _paged_batch(rng, layout, kv_lens=[1100], q_lens=[1])
    q = rng.standard_normal((1, 2 * 32)).astype(np.float32)
    expected = kernels.attention(q, host_pool, **batch, layer=0, num_heads=2, scale=0.2)
    pool = device.allocate_pages(layout)
    try:
        device.write_pages(pool, np.arange(layout.num_pages), host_pool)
        uploaded = [device.upload(batch[key]) for key in BATCH_KEYS]
        attend = device.compile("attention", "split_kv", layer=0, num_heads=2, scale=0.2)
        np.testing.assert_allclose(device.download(attend(device.upload(q), pool, *uploaded)), expected, **TOLERANCE,
                                   err_msg="split_kv attention outside a pass")
        device.begin_pass(plan_of_batch(batch, layout.page_size))
        try:
            for layer in range(2):
                np.testing.assert_allclose(device.download(attend(device.upload(q), pool, *uploaded)), expected,
                                           **TOLERANCE, err_msg=f"split_kv attention in a pass, launch {layer}")
            work = plugin.engine.backend(device.info).pass_work
            assert set(work.uploaded) == {("chunks", SPLIT_CHUNK, 0)}, "the pass's split items were uploaded once"
        finally:
            device.end_pass()
        assert plugin.engine.backend(device.info).pass_work is None, "pie_end_pass forgot the pass"
    finally:
        device.free_pages(pool)


def check_random_batches_across_variants(device: Device) -> None:
    rng = np.random.default_rng(11)
    layout = PageLayout(num_layers=1, num_pages=40, page_size=4, num_kv_heads=2, head_dim=16)
    pool = device.allocate_pages(layout)
    try:
        host_pool = rng.standard_normal(layout.shape).astype(np.float32)
        device.write_pages(pool, np.arange(layout.num_pages), host_pool)
        for trial in range(4):
            batch = random_batch(rng, 4, layout.num_pages, max_seqs=4, decode=trial % 2 == 1)
            q = rng.standard_normal((int(batch["qo_indptr"][-1]), 4 * 16)).astype(np.float32)
            expected = kernels.attention(q, host_pool, **batch, layer=0, num_heads=4, scale=0.3)
            uploaded = [device.upload(batch[key]) for key in BATCH_KEYS]
            for variant in device.kernels()["attention"]:
                attend = device.compile("attention", variant, layer=0, num_heads=4, scale=0.3)
                got = device.download(attend(device.upload(q), pool, *uploaded))
                np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=f"trial {trial} attention[{variant}]")
    finally:
        device.free_pages(pool)


def check_small_llama_against_the_cpu_engine(device: Device, steps: int = 4) -> None:
    """Prefill and greedy decode of a random 2-layer Llama: logits close, same tokens."""
    from pie.runtime.model_runner import ModelRunner, SequenceWork
    from pie.testing.models import random_weights, tiny_config

    config = tiny_config(vocab_size=300, num_layers=2, attention_bias=True)
    weights = list(random_weights(config, seed=1).items())
    cpu = EngineRegistry(env={}).engine("cpu").open(0)
    runners = [ModelRunner(config, weights, d, page_size=4, max_cached_tokens=128) for d in (cpu, device)]
    try:
        prompt = [int(t) for t in np.random.default_rng(0).integers(3, 300, 11)]
        sequences = [runner.new_sequence() for runner in runners]
        logits = [runner.step([SequenceWork(seq, prompt)])[0] for runner, seq in zip(runners, sequences)]
        for _ in range(steps):
            np.testing.assert_allclose(logits[1], logits[0], rtol=1e-3, atol=1e-3)
            token = int(np.argmax(logits[0]))
            assert int(np.argmax(logits[1])) == token
            logits = [runner.step([SequenceWork(seq, [token])])[0] for runner, seq in zip(runners, sequences)]
        assert "rms_norm_gate_up_silu" in runners[1].plan.describe()
    finally:
        for runner in runners:
            runner.close()


TOP_K_SHAPES = ((100, 1), (1000, 5), (300, 64), (256, 256), (5000, 50))


def check_top_k(device: Device, cols: int, k: int) -> None:
    """The catalogue's top_k against a stable sort: ties to the lower index, NaN skipped, padding."""
    rng = np.random.default_rng(cols + k)
    logits = rng.standard_normal((3, cols)).astype(np.float32)
    logits[1, ::7] = 0.5  # many ties
    logits[2, :3] = -np.inf
    logits[2, 5] = np.nan
    values, indices = device.compile("top_k", k=k)(device.upload(logits))
    got_values, got_indices = device.download(values), device.download(indices)
    for row in range(3):
        finite = np.where(np.isnan(logits[row]), -np.inf, logits[row])
        order = [i for i in np.argsort(-finite, kind="stable") if not np.isnan(logits[row, i])][:k]
        padding = k - len(order)  # a row with fewer than k numbers pads with index -1, value -inf
        np.testing.assert_array_equal(got_indices[row], order + [-1] * padding)
        np.testing.assert_array_equal(got_values[row], np.concatenate([logits[row, order], [-np.inf] * padding]))
