"""Decoder layers as one native call, one layer (a block) or all of them (a stack), give the logits of
their kernels run one by one, and decline (changing nothing) the passes they do not take."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest
from pie.plugins import EngineRegistry
from pie.poem.lower import KernelFailed
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import random_weights, tiny_config
from pie_engine_cpu import native
from pie_engine_cpu.layers import (
    DecodePass,
    DecodePassArguments,
    compile_block,
    compile_stack,
    rotary_frequencies,
)

CONFIGS = {
    "llama-gqa": tiny_config("llama"),
    "qwen2-qkv-bias": tiny_config("qwen2"),
    "llama-all-biases": tiny_config("llama", attention_bias=True, num_kv_heads=4),
    "llama-head-dim-40": tiny_config("llama", hidden_size=80, num_heads=2, num_kv_heads=1, head_dim=40),
    "phi3-mha": tiny_config("phi3", num_kv_heads=4),
    "qwen3-qk-norm": tiny_config("qwen3"),
    "mistral-window": tiny_config("mistral"),
    "gemma2-softcap-alternating-windows": tiny_config("gemma2"),
    "gemma3-qk-and-post-norms-two-rope-bases": tiny_config("gemma3", num_layers=3),
}
"""Windows (`pie.testing.models.TINY_WINDOW`, 5) shorter than most of the contexts below, longer than some."""


def runner(config, launches: str = "stack") -> ModelRunner:
    """A runner whose decode passes run each layer's kernels ("regions"), each layer as one native call
    ("blocks") or all layers as one ("stack")."""
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    if launches != "stack":
        device.compile_stack = lambda stack, blocks: None  # type: ignore[method-assign]  # this device only
    if launches == "regions":
        device.compile_block = lambda block: None  # type: ignore[method-assign]
    return ModelRunner(config, random_weights(config, seed=4).items(), device, page_size=4, max_cached_tokens=512)


class NativeCalls:
    """Counts the native calls of a runner's stacks and blocks: those that ran and the layers they ran,
    and those that declined."""

    def __init__(self, runner: ModelRunner) -> None:
        self.ran = self.layers = self.declined = 0
        for unit in (*runner.plan.stacks, *runner.plan.blocks):
            kernel = unit.launcher.kernel

            def counted(arguments, count, *args, kernel=kernel):
                status = kernel(arguments, count, *args)
                if status == -2:
                    self.declined += 1
                else:
                    self.ran += 1
                    self.layers += count
                return status

            unit.launcher.kernel = counted


@pytest.mark.parametrize("launches", ["stack", "blocks"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_layers_give_the_logits_of_the_layer_kernels(
    compiled: native.NativeKernels, name: str, launches: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CONFIGS[name]
    monkeypatch.setattr(compiled, "max_rows", 32)  # read as the layers compile: the prefill below has 33 rows
    fused, plain = runner(config, launches), runner(config, "regions")
    assert len(fused.plan.blocks) == config.num_layers and not plain.plan.blocks
    assert "L1               block of 5 regions -> one launch" in fused.plan.describe()
    assert len(fused.plan.stacks) == (launches == "stack")
    per_pass = 1 if launches == "stack" else config.num_layers  # native calls of a decode pass
    calls = NativeCalls(fused)
    rng = np.random.default_rng(5)
    lengths = [9, 3, 14, 1, 6]  # pages of 4: most sequences span several
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in lengths]
    sequences = {r: [r.new_sequence() for _ in prompts] for r in (fused, plain)}

    def step(works: list[tuple[int, list[int]]]) -> None:
        got, expected = (
            r.step([SequenceWork(sequences[r][i], tokens) for i, tokens in works]) for r in (fused, plain)
        )
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)

    step(list(enumerate(prompts)))  # a prefill of 33 rows: more than the native layers take
    assert calls.ran == 0
    for _ in range(6):  # decode, every sequence one row: the native layers
        step([(i, [int(rng.integers(0, config.vocab_size))]) for i in range(len(prompts))])
    assert (calls.ran, calls.layers) == (6 * per_pass, 6 * config.num_layers)
    step([(0, [3]), (1, [5, 7]), (4, [2])])  # a sequence with two rows: the plan is no decode pass's
    assert calls.declined == 0 and calls.ran == 6 * per_pass, "declined from the plan, before any native call"
    step([(i, [int(rng.integers(0, config.vocab_size))]) for i in (0, 2, 3)])
    assert (calls.ran, calls.layers) == (7 * per_pass, 7 * config.num_layers)


def test_without_a_plan_the_native_call_declines_a_pass_that_is_no_decode() -> None:
    """Launches outside a pass (no ``pie_begin_pass``) are declined by the native call itself: nothing written."""
    config = CONFIGS["llama-gqa"]
    fused, plain = runner(config), runner(config, "regions")
    fused.device.begin_pass = lambda plan: None  # type: ignore[method-assign]  # this device only
    calls = NativeCalls(fused)
    sequences = {r: [r.new_sequence() for _ in range(2)] for r in (fused, plain)}
    for tokens in ([[1, 2, 3], [4]], [[5], [6]]):
        got, expected = (
            r.step([SequenceWork(s, t) for s, t in zip(sequences[r], tokens, strict=True)]) for r in (fused, plain)
        )
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert calls.declined == 1 + config.num_layers, "the prefill: the stack, then each block"
    assert (calls.ran, calls.layers) == (1, config.num_layers), "the decode pass: the stack"


def test_more_sequences_than_the_native_rows_run_the_layer_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    config = CONFIGS["llama-gqa"]
    monkeypatch.setattr(native.load(), "max_rows", 6)  # read as the stack compiles: 7 sequences are too many
    fused, plain = runner(config), runner(config, "regions")
    calls = NativeCalls(fused)
    count = native.load().max_rows + 1
    sequences = {r: [r.new_sequence() for _ in range(count)] for r in (fused, plain)}
    for tokens in ([[i + 1, i + 2] for i in range(count)], [[i + 5] for i in range(count)]):
        got, expected = (
            r.step([SequenceWork(s, t) for s, t in zip(sequences[r], tokens, strict=True)]) for r in (fused, plain)
        )
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert calls.ran == calls.declined == 0


def test_a_block_the_native_call_cannot_run_is_left_to_its_regions() -> None:
    block = runner(CONFIGS["llama-gqa"]).plan.blocks[0].request
    assert block.layer is not None and compile_block(block) is not None
    assert compile_block(replace(block, layer=None)) is None, "no layer description"
    assert compile_block(replace(block, layer=replace(block.layer, qk_norm=True))) is None, "Q/K norms, no weights"
    assert compile_block(replace(block, layer=replace(block.layer, post_norms=True))) is None, "post-norms, no weights"
    assert compile_block(replace(block, layer=replace(block.layer, activation="relu"))) is None, "an unknown activation"
    assert compile_block(replace(block, outputs=(*block.outputs, "L0.x_attn"))) is None, "an inner value read outside"
    missing = replace(block.layer, weights=tuple((r, n) for r, n in block.layer.weights if r != "o"))
    assert compile_block(replace(block, layer=missing)) is None, "a weight the call needs is not described"
    elsewhere = replace(block.layer, weights=tuple((r, "w.other" if r == "o" else n) for r, n in block.layer.weights))
    assert compile_block(replace(block, layer=elsewhere)) is None, "a described weight the block does not read"


@pytest.mark.parametrize("architecture", ["mistral", "gemma2", "gemma3"])
def test_windows_softcaps_post_norms_and_gelu_run_as_one_native_call(architecture: str) -> None:
    """Each layer's options bound into its struct; Gemma's layers differ in window and rotary frequencies."""
    config = tiny_config(architecture, num_layers=3)
    fused = runner(config)
    [stack] = fused.plan.stacks
    blocks = tuple(block.request for block in stack.blocks)
    assert len(blocks) == config.num_layers and all(compile_block(block) is not None for block in blocks)
    calls = NativeCalls(fused)
    sequence = fused.new_sequence()
    fused.step([SequenceWork(sequence, [1, 2, 3, 4, 5, 6])])
    assert np.isfinite(fused.step([SequenceWork(sequence, [7])])).all()
    assert (calls.ran, calls.layers) == (1, config.num_layers)
    arguments = stack.launcher.arguments
    assert [layer.window for layer in arguments] == [layer.window for layer in (b.layer for b in blocks)]
    assert {layer.window for layer in arguments} == ({5} if architecture == "mistral" else {5, 0})
    assert [layer.softcap for layer in arguments] == [config.attn_softcap] * config.num_layers
    gemma = architecture != "mistral"
    assert [layer.activation for layer in arguments] == [int(gemma)] * config.num_layers
    assert all(bool(layer.attn_post_norm) == bool(layer.mlp_post_norm) == gemma for layer in arguments)
    frequencies = {layer.inv_freq for layer in arguments}
    assert len(frequencies) == (2 if architecture == "gemma3" else 1), "one table per rotary base"


def test_blocks_that_do_not_chain_are_left_to_their_launchers() -> None:
    config = tiny_config("llama", num_layers=3)
    [stack] = runner(config).plan.stacks
    blocks = tuple(block.request for block in stack.blocks)
    assert compile_stack(stack.request, blocks) is not None
    assert compile_stack(stack.request, (blocks[1], blocks[0], blocks[2])) is None, "out of order"
    assert compile_stack(stack.request, (blocks[0], blocks[2])) is None, "a layer left out"
    assert compile_stack(replace(stack.request, outputs=("L0.x_out", "L2.x_out")), blocks) is None, "read outside"
    not_a_layer = replace(blocks[1], layer=None)
    assert compile_stack(stack.request, (blocks[0], not_a_layer, blocks[2])) is None


def test_a_weight_of_the_wrong_shape_is_named() -> None:
    fused = runner(CONFIGS["llama-gqa"])
    block = fused.plan.blocks[0].request
    values = {name: fused._env[fused.plan.slots[name]] for name in block.inputs if name.startswith("w.")}
    values["w.L0.o"] = np.zeros((64, 48), dtype=np.float32)
    values["x.embed"] = np.zeros((1, 64), dtype=np.float32)
    with pytest.raises(ValueError, match=r"decoder layer 0 weight o: expected C-contiguous float32 \(64, 64\)"):
        compile_block(block)(*(values.get(name) for name in block.inputs))


def test_the_decode_pass_points_at_each_pass_arrays_in_int32() -> None:
    decode_pass = DecodePass()
    for batch in (1, 3, 2):  # the buffer grows, then is reused
        positions = np.arange(batch, dtype=np.int64) + 40
        arrays = {
            "positions": positions,
            "slots": positions + 100,
            "qo_indptr": np.arange(batch + 1),
            "page_indices": np.arange(4 * batch)[::-1].copy(),
            "page_indptr": np.arange(batch + 1) * 4,
            "last_lens": np.full(batch, 3),
        }
        address = decode_pass.fill(*arrays.values())
        arguments = DecodePassArguments.from_address(address)
        assert (arguments.batch, arguments.tokens) == (batch, batch)
        for name, expected in arrays.items():
            pointer = ctypes.cast(getattr(arguments, name), ctypes.POINTER(ctypes.c_int32))
            assert np.ctypeslib.as_array(pointer, shape=expected.shape).tolist() == expected.tolist(), name


def test_rotary_frequencies_are_float32_and_must_fit_the_head() -> None:
    inv_freq = np.array([1.0, 0.5, 0.25, 0.125])  # float64: converted
    assert rotary_frequencies(inv_freq, 8).dtype == np.float32
    assert rotary_frequencies(inv_freq, 8).tolist() == inv_freq.tolist()
    with pytest.raises(ValueError, match=r"rotary inverse frequencies: expected 4, got \(3,\)"):
        rotary_frequencies(np.ones(3, np.float32), 8)


def test_each_layer_points_at_its_rotary_frequencies_in_float32() -> None:
    """Bound with its weights: Gemma 3's sliding layers at the local base's table, its global ones at the other."""
    fused = runner(tiny_config("gemma3", num_layers=2))
    [stack] = fused.plan.stacks
    sequence = fused.new_sequence()
    fused.step([SequenceWork(sequence, [1, 2, 3])])
    fused.step([SequenceWork(sequence, [4])])
    for arguments, block in zip(stack.launcher.arguments, stack.blocks, strict=True):
        expected = fused._env[fused.plan.slots[block.request.layer.inv_freq]]
        pointer = ctypes.cast(arguments.inv_freq, ctypes.POINTER(ctypes.c_float))
        assert np.ctypeslib.as_array(pointer, shape=expected.shape).tolist() == expected.tolist()


def test_the_decode_pass_points_at_the_running_plans_arrays() -> None:
    """Inside a pass the struct points at the plan's int32 arrays, not at the launch's own."""
    from pie.contract import PassPlan
    from pie_engine_cpu import kernels

    i32 = np.int32
    plan = PassPlan.from_batch(
        ids=np.zeros(2, i32), positions=np.array([7, 3], i32), slots=np.array([7, 19], i32),
        qo_indptr=np.array([0, 1, 2], i32), kv_page_indices=np.array([0, 1, 2], i32),
        kv_page_indptr=np.array([0, 1, 3], i32), kv_last_page_lens=np.array([8, 4], i32),
        sample_rows=np.array([0, 1], i32), page_size=16,
    )
    stale = [np.zeros(n, i32) for n in (2, 2, 3, 3, 3, 2)]  # the launch's arrays: what the plan replaces
    decode_pass = DecodePass()  # held: the struct is its own
    kernels.begin_pass(plan)
    try:
        arguments = DecodePassArguments.from_address(decode_pass.fill(*stale))
    finally:
        kernels.end_pass()
    fields = {"positions": "positions", "slots": "slots", "qo_indptr": "qo_indptr", "page_indices": "kv_page_indices",
              "page_indptr": "kv_page_indptr", "last_lens": "kv_last_page_lens"}
    for field, name in fields.items():
        pointer = ctypes.cast(getattr(arguments, field), ctypes.POINTER(ctypes.c_int32))
        assert np.ctypeslib.as_array(pointer, shape=(len(getattr(plan, name)),)).tolist() == getattr(plan, name).tolist()
    assert (arguments.batch, arguments.tokens) == (2, 2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kv_page_indices", "pages", "decoder layers: kv_page_indices holds page {pages}, outside the pool's {pages} pages"),
        ("kv_page_indices", -1, "decoder layers: kv_page_indices holds page -1, outside the pool's {pages} pages"),
        ("slots", "slots", "decoder layers: slot {slots} is outside the pool's {pages} pages of 4 tokens"),
    ],
    ids=["page-past-the-pool", "negative-page", "slot-past-the-pool"],
)
def test_a_decode_pass_whose_pages_or_slots_lie_outside_the_pool_is_refused_untouched(
    field: str, value: object, message: str
) -> None:
    """The stack's native call checks the pass's page tables and slots once, before its first layer: a
    damaged one is refused with the value named, and no page of the pool is written."""
    fused = runner(CONFIGS["llama-gqa"])
    sequences = [fused.new_sequence() for _ in range(2)]
    fused.step([SequenceWork(s, t) for s, t in zip(sequences, ([1, 2, 3], [4, 5]), strict=True)])
    calls = NativeCalls(fused)
    pool = fused.pages.handle
    before = pool.copy()
    batch = fused.prepare([SequenceWork(s, [6]) for s in sequences])
    names = {"pages": pool.shape[1], "slots": pool.shape[1] * pool.shape[3]}
    getattr(batch, field)[0] = names.get(value, value)  # the plan shares the batch's arrays
    with pytest.raises(KernelFailed, match="kernel stack L0-L1 on engine 'cpu' failed: ValueError: " + message.format(**names)):
        fused.forward(batch)
    assert calls.ran == 1 and calls.declined == 0, "the stack's call refused it"
    np.testing.assert_array_equal(pool, before)
