"""`pie profile plot`: each kernel's measured times per variant against rows, one line per size bucket
(and KV threshold, for attention's buckets that name one).

Needs matplotlib (``pip install 'pie-core[plot]'``).
"""

from __future__ import annotations

from io import BytesIO

from pie.profiles.schema import ANY, Profile


class PlotUnavailable(RuntimeError):
    pass


def plot_profile(profile: Profile) -> bytes:
    """A PNG: per kernel, median microseconds (quantile band as error bars) vs rows, log-log.

    Filled markers are the chosen variant of each bucket.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("plotting needs matplotlib: pip install 'pie-core[plot]'") from None
    kernels = [k for k in profile.kernels if k.buckets]
    if not kernels:
        raise PlotUnavailable(f"profile {profile.name!r} holds no measurements to plot")
    figure, axes = plt.subplots(len(kernels), 1, figsize=(9, 3.6 * len(kernels)), squeeze=False)
    markers = "osd^v<>p*h"
    for ax, tuning in zip(axes[:, 0], kernels, strict=True):
        groups = sorted({(b.size, b.min_kv_tokens) for b in tuning.buckets})
        for size_index, (size, min_kv) in enumerate(groups):
            buckets = [b for b in tuning.buckets if (b.size, b.min_kv_tokens) == (size, min_kv)]
            where = "any size" if size == ANY else f"size 2^{size.bit_length() - 1}"
            where += "" if min_kv == ANY else f", from {min_kv} keys"
            for variant_index, variant in enumerate(tuning.variants):
                points = [(b.rows, t, b.variant == variant) for b in buckets if (t := b.time(variant)) is not None]
                if not points:
                    continue
                xs = [r for r, _, _ in points]
                medians = [t.median for _, t, _ in points]
                spread = [[t.median - t.low for _, t, _ in points], [t.high - t.median for _, t, _ in points]]
                color = f"C{variant_index}"
                style = "-" if size_index == 0 else ("--", ":", "-.")[size_index % 3]
                ax.errorbar(
                    xs,
                    medians,
                    yerr=spread,
                    color=color,
                    linestyle=style,
                    alpha=0.8,
                    capsize=2,
                    label=f"{variant} @ {where}",
                )
                chosen = [(r, m) for (r, _, won), m in zip(points, medians, strict=True) if won]
                if chosen:
                    ax.scatter(
                        *zip(*chosen, strict=True), color=color, marker=markers[size_index % len(markers)], zorder=3
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{tuning.kernel} (default {tuning.default})")
        ax.set_xlabel("rows")
        ax.set_ylabel("microseconds per launch")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", ncol=2)
    figure.suptitle(f"{profile.name}: {profile.device.name} ({profile.engine} {profile.engine_version})")
    figure.tight_layout()
    png = BytesIO()
    try:
        figure.savefig(png, format="png", dpi=100)
    finally:
        plt.close(figure)
    return png.getvalue()
