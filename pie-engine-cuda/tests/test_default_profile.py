"""The CUDA engine lists concrete variants only; its shipped default profile chooses GEMV for decode-sized
batches, as the engine's own ``auto`` did before, and the listed default GEMM above; attention per token
up to 127 tokens a pass, query tiles above, and split-KV for passes of fewer than 16 tokens whose longest
sequence reads at least 2048 keys."""

from __future__ import annotations

import numpy as np
import pytest
from pie.plugins import Device
from pie.poem.lower import RunningPass, bucketed_launcher
from pie.profiles.loader import check_fits, parse_profile
from pie.profiles.schema import ProfileChooser
from pie.profiles.shipped import shipped_profiles
from pie_engine_cuda import __version__
from pie_engine_cuda.launchers import ATTENTION_VARIANTS, PROJECTION_VARIANTS, kernel_listing

PROJECTIONS = ("linear", "rms_norm_linear", "linear_add", "rms_norm_gate_up_silu")


def _default_profile():
    [text] = shipped_profiles("pie_engine_cuda")
    profile = parse_profile(text, "cuda-default.toml")
    assert profile.is_default and profile.device.kind == ""
    return profile


def old_auto(rows: int, tensor_cores: bool) -> str:
    """What the engine's ``auto`` projection ran for ``rows`` rows."""
    return "gemv" if rows <= 16 else "tc" if tensor_cores else "tiled"


def test_no_variant_is_auto_and_the_default_gemm_leads() -> None:
    for tensor_cores, default in ((True, "tc"), (False, "tiled")):
        listing = kernel_listing(tensor_cores)
        assert all("auto" not in listing[name] for name in (*PROJECTIONS, "attention"))
        assert {listing[name][0] for name in PROJECTIONS} == {default}
        assert set(listing["linear"]) == set(PROJECTION_VARIANTS) - ({"tc"} if not tensor_cores else set())


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_the_default_profile_picks_what_auto_picked(tensor_cores: bool) -> None:
    profile = _default_profile()
    listing = kernel_listing(tensor_cores)
    check_fits(profile, "cuda", __version__, listing)
    chooser = ProfileChooser(None, profile)
    for kernel in PROJECTIONS:
        buckets = chooser(kernel)
        assert buckets is not None
        buckets = buckets.restricted(listing[kernel])
        launchers = {variant: (lambda *args, v=variant: v) for variant in listing[kernel]}
        launch = bucketed_launcher(kernel, buckets, launchers, launchers[listing[kernel][0]])
        for weight in ((576, 576), (4096, 11008)):
            for rows in (1, 2, 3, 8, 16, 32, 100, 4096):
                args = [np.zeros((rows, weight[1]), np.float32), np.zeros(weight, np.float32), None]
                if kernel in ("rms_norm_linear", "rms_norm_gate_up_silu"):
                    args.insert(1, np.zeros(weight[1], np.float32))
                assert launch(*args) == old_auto(rows, tensor_cores), (kernel, weight, rows)


def _attention_launcher(running: RunningPass | None):
    buckets = ProfileChooser(None, _default_profile())("attention")
    assert buckets is not None
    launchers = {variant: (lambda *args, v=variant: v) for variant in ATTENTION_VARIANTS}
    restricted = buckets.restricted(ATTENTION_VARIANTS)
    return bucketed_launcher("attention", restricted, launchers, launchers["decode"], running)


def test_the_default_profile_runs_attention_per_token_for_small_passes_and_tiles_above() -> None:
    launch = _attention_launcher(None)  # outside a pass: no KV length, the buckets without one
    for tokens in (1, 3, 15, 16, 64, 127, 128, 4096):
        assert launch(np.zeros((tokens, 8 * 64), np.float32)) == ("decode" if tokens < 128 else "prefill"), tokens


@pytest.mark.parametrize("kv", [1, 2047, 2048, 5000, 1 << 20])
def test_the_default_profile_splits_the_keys_of_few_tokens_over_long_contexts(kv: int) -> None:
    running = RunningPass()
    running.max_kv_len = kv
    launch = _attention_launcher(running)
    for tokens in (1, 3, 8, 15, 16, 64, 127, 128, 4096):
        expected = "split_kv" if tokens < 16 and kv >= 2048 else "decode" if tokens < 128 else "prefill"
        assert launch(np.zeros((tokens, 8 * 64), np.float32)) == expected, (tokens, kv)


def _record_attention_kernels(device: Device, runner) -> list[str]:
    """Which of the engine's attention kernels each launch of ``runner``'s attention runs, in order."""
    launched: list[str] = []
    [options] = {step.request.options for step in runner.plan.steps if step.kernel == "attention"}
    for variant in (None, *ATTENTION_VARIANTS):
        attention = device.compile("attention", variant, **dict(options))  # the instances the plan launches
        for name in ("_decode", "_split", "_merge", "_prefill"):
            bound = getattr(attention, name)
            setattr(attention, name, lambda *grid, _bound=bound, _name=name: (launched.append(_name[1:]), _bound(*grid)))
    return launched


def test_a_long_decode_pass_launches_split_kv_and_a_short_one_decode_through_the_profile(
    emulated_device: Device,
) -> None:
    from pie.runtime.model_runner import ModelRunner, SequenceWork
    from pie.testing.models import random_weights, tiny_config

    config = tiny_config(vocab_size=300, num_layers=1)
    chooser = ProfileChooser(None, _default_profile())
    runner = ModelRunner(config, list(random_weights(config, seed=2).items()), emulated_device, page_size=16,
                         max_cached_tokens=4096, choose_variant=chooser)
    try:
        launched = _record_attention_kernels(emulated_device, runner)
        long, short = runner.new_sequence(), runner.new_sequence()
        runner.prepare([SequenceWork(long, [7] * 2100, logits=False)])  # 2100 keys cached (never computed)
        runner.step([SequenceWork(short, [5, 6, 7])])
        assert launched == ["decode"], "a 3-token prompt over 3 keys runs per token"
        launched.clear()
        logits = runner.step([SequenceWork(long, [8])])
        assert launched == ["split", "merge"], "one token over 2101 keys: split-KV chunks, then their merge"
        assert logits.shape == (1, 300) and np.isfinite(logits).all()
        launched.clear()
        runner.step([SequenceWork(short, [8])])
        assert launched == ["decode"], "one token over 4 keys"
        launched.clear()
        runner.step([SequenceWork(short, [9]), SequenceWork(long, [9])])
        assert launched == ["split", "merge"], "the pass's longest sequence decides"
    finally:
        runner.close()
