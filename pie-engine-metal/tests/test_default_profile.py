"""The Metal engine lists concrete projection variants only; its shipped default profile chooses GEMV for
decode-sized batches, as the engine's own ``auto`` did before, and the listed default tiles above."""

from __future__ import annotations

import numpy as np
import pytest
from pie.poem.lower import bucketed_launcher
from pie.profiles.loader import check_fits, parse_profile
from pie.profiles.schema import ProfileChooser
from pie.profiles.shipped import shipped_profiles
from pie_engine_metal import __version__, launchers

GEMV_MAX_TOKENS = 8
"""Up to this many tokens the engine's ``auto`` projection ran GEMV."""


def old_auto(rows: int, simdgroup_matrices: bool) -> str:
    """What the engine's ``auto`` projection ran for ``rows`` tokens."""
    return "gemv" if rows <= GEMV_MAX_TOKENS else "simdgroup" if simdgroup_matrices else "tiled"


@pytest.mark.parametrize("simdgroup_matrices", [True, False])
def test_the_default_profile_picks_what_auto_picked(simdgroup_matrices: bool) -> None:
    [text] = shipped_profiles("pie_engine_metal")
    profile = parse_profile(text, "metal-default.toml")
    listing = launchers.variants(simdgroup_matrices)
    assert profile.is_default and all("auto" not in variants for variants in listing.values())
    check_fits(profile, "metal", __version__, listing)
    chooser = ProfileChooser(None, profile)
    for kernel in launchers.PROJECTIONS:
        buckets = chooser(kernel)
        assert buckets is not None
        buckets = buckets.restricted(listing[kernel])
        named = {variant: (lambda *args, v=variant: v) for variant in listing[kernel]}
        launch = bucketed_launcher(kernel, buckets, named, named[listing[kernel][0]])
        for weight in ((576, 576), (4096, 11008)):
            for rows in (1, 2, 3, 4, 8, 16, 100, 4096):
                args = [np.zeros((rows, weight[1]), np.float32), np.zeros(weight, np.float32), None]
                if kernel.startswith("rms_norm"):
                    args.insert(1, np.zeros(weight[1], np.float32))
                assert launch(*args) == old_auto(rows, simdgroup_matrices), (kernel, weight, rows)
