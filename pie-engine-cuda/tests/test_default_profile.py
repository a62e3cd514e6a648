"""The CUDA engine lists concrete variants only; its shipped default profile chooses GEMV for decode-sized
batches, as the engine's own ``auto`` did before, and the listed default GEMM above; attention per token
up to 64 tokens a pass, query tiles above."""

from __future__ import annotations

import numpy as np
import pytest
from pie.poem.lower import bucketed_launcher
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


def test_the_default_profile_runs_attention_per_token_for_small_passes_and_tiles_above() -> None:
    buckets = ProfileChooser(None, _default_profile())("attention")
    assert buckets is not None
    launchers = {variant: (lambda *args, v=variant: v) for variant in ATTENTION_VARIANTS}
    launch = bucketed_launcher("attention", buckets.restricted(ATTENTION_VARIANTS), launchers, launchers["decode"])
    for tokens in (1, 3, 64, 127, 128, 4096):
        assert launch(np.zeros((tokens, 8 * 64), np.float32)) == ("decode" if tokens < 128 else "prefill"), tokens
