"""Attention's buckets keyed on the pass's longest KV length (``min_kv_tokens``): how files say it, how
the buckets of a profile over a default profile resolve, how a launch reads the pass's KV length, and
what the tuner measures for it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from pie.hookspecs import hookimpl
from pie.poem.graph import Graph
from pie.poem.lower import KernelFailed, RunningPass, ShapeBuckets, bucketed_launcher, lower
from pie.profiles import ProfileError, dump_profile, parse_profile
from pie.profiles.cli import describe_choices, diff_profiles
from pie.profiles.schema import ANY, Bucket, KernelTuning, ProfileBuckets, ProfileChooser, Timing
from pie.profiles.shipped import shipped_profiles
from pie.profiles.tuner import Tuner, TuneSettings
from pie.profiles.workloads import LONG_CACHED_TOKENS, Dims
from pie.runtime.pass_plan import PassPlan
from profile_fakes import VERSION, FakeClock, FakeEngine, make_profile, open_fake

VARIANTS = ("plain", "split")
WIDTH = 64
"""Query width of the attention launches here: their size bucket is 64."""


class AttentionEngine(FakeEngine):
    """A fake engine with two attention variants; each launch records (variant, rows, longest KV length)
    and costs what ``attention_cost`` says on the fake clock."""

    def __init__(self, clock: FakeClock | None = None):
        super().__init__(clock=clock, kernels={"attention": VARIANTS})
        self.attention_launches: list[tuple[str, int, int]] = []

    @hookimpl
    def pie_compile_kernel(self, device, request):  # type: ignore[override]
        variant = request.variant or VARIANTS[0]

        def attention(q, pool, qo_indptr, page_indices, page_indptr, last_lens):
            kv = int(((np.diff(page_indptr) - 1) * pool.shape[3] + last_lens).max())
            self.attention_launches.append((variant, q.shape[0], kv))
            self.clock.advance_us(attention_cost(variant, q.shape[0], kv) * (1 + 0.01 * self.jitter.random()))
            return np.array(q)

        return attention


def attention_cost(variant: str, rows: int, kv: int) -> float:
    """``plain`` walks every key once, rows in parallel; ``split`` pays a merge and a row's worth each."""
    return 10.0 + kv / 100 if variant == "plain" else 30.0 + kv / 1000 + rows


def default_text(buckets: str, kernel: str = "attention") -> str:
    return f"""schema = 1
name = "fake-default"
engine = "fake"
engine_version = "{VERSION}"

[device]

[tools]

[tune]
mode = "default"

{buckets.replace("KERNEL", kernel)}"""


SPLIT_FROM_1024 = """[[kernels.KERNEL.buckets]]
rows = 1
min_kv_tokens = 1024
variant = "split"

[[kernels.KERNEL.buckets]]
rows = 2
min_kv_tokens = 1024
variant = "split"

[[kernels.KERNEL.buckets]]
rows = 1
min_kv_tokens = 4096
variant = "plain"
"""
"""Split for 1 row from 1024 to 4095 keys (plain again from 4096), for 2-3 rows from 1024 keys on."""


def _launcher(buckets: ShapeBuckets, running: RunningPass | None) -> object:
    launchers = {v: (lambda *args, v=v: v) for v in VARIANTS}
    return bucketed_launcher("attention", buckets.restricted(VARIANTS), launchers, launchers["plain"], running)


def _choices(buckets: ShapeBuckets, kv_lens: tuple[int, ...], rows: tuple[int, ...] = (1, 2, 3, 4)) -> dict:
    running = RunningPass()
    launch = _launcher(buckets, running)
    found = {}
    for kv in kv_lens:
        running.max_kv_len = kv
        found[kv] = tuple(launch(np.zeros((n, WIDTH), np.float32)) for n in rows)  # type: ignore[operator]
    return found


# -- files ---------------------------------------------------------------------------------------------


def test_a_default_profile_names_min_kv_tokens_and_writes_it_back() -> None:
    profile = parse_profile(default_text(SPLIT_FROM_1024), "d.toml")
    [attention] = profile.kernels
    assert [(b.rows, b.min_kv_tokens, b.variant) for b in attention.buckets] == [
        (1, 1024, "split"), (2, 1024, "split"), (1, 4096, "plain")
    ]
    assert attention.choices() == {(ANY, 1, 1024): "split", (ANY, 2, 1024): "split", (ANY, 1, 4096): "plain"}
    again = dump_profile(profile)
    assert again.count("min_kv_tokens = ") == 3
    assert parse_profile(again, "again.toml") == profile


def test_a_measured_bucket_may_name_it_and_its_times_still_must_justify_the_choice() -> None:
    base = make_profile()
    fast, slow = Timing(15.0, 16.0, 17.5), Timing(48.0, 50.0, 52.0)
    attention = KernelTuning("attention", "plain", VARIANTS, (
        Bucket(64, 1, "plain", (("plain", fast), ("split", slow)), ((64,),)),
        Bucket(64, 1, "split", (("plain", slow), ("split", fast)), ((64,),), min_kv_tokens=4096),
    ))
    profile = replace(base, kernels=(*base.kernels, attention))
    text = dump_profile(profile)
    assert parse_profile(text) == profile
    unjustified = text.replace("split = [15.0, 16.0, 17.5]", "split = [49.0, 50.0, 51.0]")
    with pytest.raises(ProfileError, match="do not beat the default 'plain'"):
        parse_profile(unjustified)


def _line_of(text: str, needle: str) -> int:
    return text.count("\n", 0, text.index(needle)) + 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1000", r"min_kv_tokens: 1000 is not a power of two"),
        ("0", r"min_kv_tokens: 0 is outside 1\.\."),
        ("-1024", r"min_kv_tokens: -1024 is outside 1\.\."),
        (str(1 << 31), rf"min_kv_tokens: {1 << 31} is outside 1\.\."),
        ('"1024"', r"min_kv_tokens: must be an integer, not a string"),
        ("true", r"min_kv_tokens: must be an integer, not a boolean"),
        ("1024.0", r"min_kv_tokens: must be an integer, not a float"),
    ],
)
def test_a_bad_min_kv_tokens_names_its_file_and_line(value: str, message: str) -> None:
    good = default_text(SPLIT_FROM_1024)
    text = good.replace("min_kv_tokens = 4096", f"min_kv_tokens = {value}")
    with pytest.raises(ProfileError, match=message) as caught:
        parse_profile(text, "mine.toml")
    assert caught.value.line == _line_of(good, "min_kv_tokens = 4096")
    assert str(caught.value).startswith(f"mine.toml:{caught.value.line}: ")


def test_min_kv_tokens_on_a_kernel_other_than_attention_is_refused_at_its_line() -> None:
    text = default_text(SPLIT_FROM_1024.replace("split", "rows").replace("plain", "blas"), kernel="linear")
    with pytest.raises(ProfileError, match=r"only attention buckets depend on the pass's KV length, not linear's") as caught:
        parse_profile(text, "mine.toml")
    assert caught.value.line == _line_of(text, "min_kv_tokens = 1024")


def test_one_cell_twice_is_refused_but_one_size_and_rows_at_two_thresholds_is_not() -> None:
    twice = default_text(SPLIT_FROM_1024.replace("min_kv_tokens = 4096", "min_kv_tokens = 1024"))
    with pytest.raises(ProfileError, match=r"buckets\[2\]: every size, rows 1, from 1024 keys is already given by bucket 0"):
        parse_profile(twice)
    parse_profile(default_text(SPLIT_FROM_1024))


def test_every_shipped_profile_still_reads_and_only_cuda_names_kv_lengths() -> None:
    found = {}
    for package in ("pie_engine_cpu", "pie_engine_cuda", "pie_engine_metal", "pie_engine_vulkan", "pie_engine_wgpu"):
        for index, text in enumerate(shipped_profiles(package)):
            profile = parse_profile(text, f"{package} {index}")
            found[profile.name] = {b.min_kv_tokens for k in profile.kernels for b in k.buckets}
    assert len(found) >= 7
    assert found.pop("cuda-default") == {ANY, 2048}
    assert all(keys == {ANY} for keys in found.values()), found


# -- resolution ------------------------------------------------------------------------------------------


def test_each_threshold_holds_up_to_the_next_and_a_bucket_without_it_below() -> None:
    buckets = ProfileChooser(None, parse_profile(default_text(SPLIT_FROM_1024)))("attention")
    assert isinstance(buckets, ProfileBuckets) and buckets.kv_thresholds() == (1024, 4096)
    assert _choices(buckets, (0, 1023, 1024, 4095, 4096, 1 << 20)) == {
        0: ("plain", "plain", "plain", "plain"),
        1023: ("plain", "plain", "plain", "plain"),
        1024: ("split", "split", "split", "plain"),
        4095: ("split", "split", "split", "plain"),
        4096: ("plain", "split", "split", "plain"),
        1 << 20: ("plain", "split", "split", "plain"),
    }


def test_a_more_specific_row_count_wins_over_a_threshold_for_every_row_count() -> None:
    text = default_text("""[[kernels.KERNEL.buckets]]
min_kv_tokens = 2048
variant = "split"

[[kernels.KERNEL.buckets]]
rows = 4
variant = "plain"
""")
    buckets = ProfileChooser(None, parse_profile(text))("attention")
    assert _choices(buckets, (100, 5000)) == {100: ("plain",) * 4, 5000: ("split", "split", "split", "plain")}


def _measured(*buckets: Bucket):
    """A measured profile for the fake engine whose attention buckets are ``buckets``."""
    return replace(make_profile(), kernels=(KernelTuning("attention", "plain", VARIANTS, buckets),))


FAST, SLOW = Timing(15.0, 16.0, 17.5), Timing(48.0, 50.0, 52.0)


def test_a_measured_bucket_without_the_key_hides_the_default_profiles_thresholds_for_its_size() -> None:
    base = parse_profile(default_text(SPLIT_FROM_1024))
    kept = _measured(Bucket(WIDTH, 1, "plain", (("plain", FAST), ("split", SLOW)), ((WIDTH,),)))
    buckets = ProfileChooser(kept, base)("attention")
    assert _choices(buckets, (2000,)) == {2000: ("plain", "split", "split", "plain")}
    running = RunningPass()
    running.max_kv_len = 2000
    launch = _launcher(buckets, running)
    assert launch(np.zeros((1, 2 * WIDTH), np.float32)) == "split", "another size keeps the default profile's"  # type: ignore[operator]


def test_a_measured_threshold_over_the_default_profile_holds_from_its_keys_only() -> None:
    base = parse_profile(default_text(SPLIT_FROM_1024))
    measured = _measured(Bucket(WIDTH, 4, "split", (("plain", SLOW), ("split", FAST)), ((WIDTH,),), 8192))
    buckets = ProfileChooser(measured, base)("attention")
    assert _choices(buckets, (100, 2000, 8192)) == {
        100: ("plain",) * 4, 2000: ("split", "split", "split", "plain"), 8192: ("plain", "split", "split", "split")
    }


def test_a_default_keeping_bucket_of_the_default_profile_still_hides_its_catch_all() -> None:
    """cuda-default's shape: prefill for every row count, decode (the engine default) for few rows. A
    measured profile naming that default must not let the catch-all take the few rows of other sizes."""
    base = parse_profile(default_text("""[[kernels.KERNEL.buckets]]
variant = "split"

[[kernels.KERNEL.buckets]]
rows = 1
variant = "plain"
"""))
    measured = _measured(Bucket(4 * WIDTH, 8, "plain", (("plain", FAST), ("split", SLOW)), ((4 * WIDTH,),)))
    buckets = ProfileChooser(measured, base)("attention")
    assert _choices(buckets, (0,), rows=(1, 2)) == {0: ("plain", "split")}


def test_buckets_describe_their_thresholds() -> None:
    buckets = ProfileChooser(None, parse_profile(default_text(SPLIT_FROM_1024)))("attention")
    assert buckets.describe() == (
        "split at 1,2 rows (any size, from 1024 keys); plain at 1 rows (any size, from 4096 keys)"
    )


# -- launches ----------------------------------------------------------------------------------------------


class Unreadable:
    """A running pass that fails the test if a launcher reads it."""

    @property
    def max_kv_len(self) -> int:
        raise AssertionError("a launcher without KV buckets read the running pass")


def test_buckets_without_the_key_never_read_the_running_pass() -> None:
    buckets = ShapeBuckets(((WIDTH, 1, "split"),))
    launch = _launcher(buckets, Unreadable())  # type: ignore[arg-type]
    assert [launch(np.zeros((n, WIDTH), np.float32)) for n in (1, 2, 1)] == ["split", "plain", "split"]  # type: ignore[operator]


def test_a_launch_outside_a_pass_takes_the_buckets_without_the_key() -> None:
    buckets = ProfileChooser(None, parse_profile(default_text(SPLIT_FROM_1024)))("attention")
    assert buckets is not None
    launch = _launcher(buckets, None)
    assert launch(np.zeros((1, WIDTH), np.float32)) == "plain"  # type: ignore[operator]


def _pass_plan(kv_lens: list[int], page_size: int = 16) -> PassPlan:
    """One new token after each sequence's cached ones."""
    pages = [-(-kv // page_size) for kv in kv_lens]
    i32 = np.int32
    return PassPlan.from_batch(
        ids=np.zeros(len(kv_lens), i32), positions=np.array([kv - 1 for kv in kv_lens], i32),
        slots=np.zeros(len(kv_lens), i32), qo_indptr=np.arange(len(kv_lens) + 1, dtype=i32),
        kv_page_indices=np.arange(sum(pages), dtype=i32), kv_page_indptr=np.cumsum([0, *pages]).astype(i32),
        kv_last_page_lens=np.array([kv - (p - 1) * page_size for kv, p in zip(kv_lens, pages)], i32),
        sample_rows=np.arange(len(kv_lens), dtype=i32), page_size=page_size,
    )


def _attention_plan(engine: AttentionEngine, chooser: ProfileChooser):
    graph = Graph()
    inputs = ("in.q", "pool", "in.qo_indptr", "in.kv_page_indices", "in.kv_page_indptr", "in.kv_last_page_lens")
    graph.add("attention", inputs, "logits", "attention", layer=0, num_heads=4, scale=0.25)
    return lower(graph, open_fake(engine), choose_variant=chooser)


def _run(plan, pass_plan: PassPlan | None, kv_lens: list[int]) -> None:
    batch = pass_plan or _pass_plan(kv_lens)
    env = plan.new_env()
    plan.bind(env, "in.q", np.zeros((len(kv_lens), WIDTH), np.float32))
    plan.bind(env, "pool", np.zeros((1, 64, 2, 16, 1, 16), np.float32))
    for name in ("qo_indptr", "kv_page_indices", "kv_page_indptr", "kv_last_page_lens"):
        plan.bind(env, f"in.{name}", getattr(batch, name))
    plan.run(env, pass_plan)


def test_a_lowered_plan_reads_the_longest_kv_length_from_the_pass_plan() -> None:
    engine = AttentionEngine()
    plan = _attention_plan(engine, ProfileChooser(None, parse_profile(default_text(SPLIT_FROM_1024))))
    (step,) = plan.steps
    assert "from 1024 keys" in plan.describe() and step.buckets is not None
    for kv_lens in ([100], [100, 3000], [5000], [5000, 20]):
        _run(plan, _pass_plan(kv_lens), kv_lens)
    _run(plan, None, [3000])  # no pass plan: the buckets without the key
    assert engine.attention_launches == [
        ("plain", 1, 100), ("split", 2, 3000), ("plain", 1, 5000), ("split", 2, 5000), ("plain", 1, 3000)
    ]
    assert plan.running.max_kv_len == 0, "a pass's KV length does not outlive it"


def test_a_failing_pass_forgets_its_kv_length(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = AttentionEngine()
    plan = _attention_plan(engine, ProfileChooser(None, parse_profile(default_text(SPLIT_FROM_1024))))
    monkeypatch.setattr(engine.clock, "advance_us", lambda us: 1 / 0)
    with pytest.raises(KernelFailed, match="ZeroDivisionError"):
        _run(plan, _pass_plan([3000]), [3000])
    assert plan.running.max_kv_len == 0


def test_the_model_runner_hands_each_pass_its_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from pie.plugins import EngineRegistry
    from pie.poem.lower import Plan
    from pie.runtime.model_runner import ModelRunner, SequenceWork
    from pie.testing.models import random_weights, tiny_config

    seen: list[int] = []
    real_run = Plan.run

    def run(self, env, pass_plan=None):
        seen.append(-1 if pass_plan is None else pass_plan.max_kv_len)
        return real_run(self, env, pass_plan)

    monkeypatch.setattr(Plan, "run", run)
    config = tiny_config(vocab_size=100, num_layers=1)
    device = EngineRegistry(env={}).engine("cpu").open(0)
    runner = ModelRunner(config, list(random_weights(config, seed=0).items()), device, page_size=4)
    try:
        sequence = runner.new_sequence()
        runner.step([SequenceWork(sequence, [1, 2, 3, 4, 5])])
        runner.step([SequenceWork(sequence, [6])])
        runner.step([SequenceWork(sequence, [7], logits=False)])  # no row sampled: a substitute row
    finally:
        runner.close()
    assert seen == [5, 6, 7]


# -- tuning and display -------------------------------------------------------------------------------------

DIMS = Dims(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=400)


def _tuner(tmp_path: Path) -> tuple[Tuner, AttentionEngine]:
    clock = FakeClock()
    engine = AttentionEngine(clock)
    return Tuner(open_fake(engine), TuneSettings.quick(), tmp_path / "partial.json", DIMS, clock=clock), engine


def test_a_quick_tune_times_attention_over_a_long_context_at_up_to_64_rows(tmp_path: Path) -> None:
    tuner, _ = _tuner(tmp_path)
    cells = [cell for cell in tuner.cells() if cell.site.kernel == "attention"]
    short = sorted((c.site.label, c.rows) for c in cells if c.site.min_kv_tokens == ANY)
    long = sorted((c.site.label, c.rows) for c in cells if c.site.min_kv_tokens == LONG_CACHED_TOKENS)
    assert len(short) == 18 and len(long) == 14, "9 row counts x 2 sites as before, 7 x 2 more"
    assert max(rows for _, rows in long) == 64


def test_the_tuner_chooses_per_kv_length_and_its_profile_resolves_that_way(tmp_path: Path) -> None:
    tuner, engine = _tuner(tmp_path)
    profile = parse_profile(dump_profile(tuner.run()), "tuned.toml")
    assert {kv for variant, rows, kv in engine.attention_launches} >= {257, 4097, 4096 + 64}
    [attention] = profile.kernels
    long = {b.rows: b.variant for b in attention.buckets if b.min_kv_tokens == LONG_CACHED_TOKENS}
    short = {b.rows: b.variant for b in attention.buckets if b.min_kv_tokens == ANY}
    assert long == {1: "split", 2: "split", 4: "split", 8: "split", 16: "plain", 32: "plain", 64: "plain"}
    assert short == dict.fromkeys((1, 2, 4, 8, 16), "plain"), "split, losing ground from 8 rows, is pruned above 16"
    buckets = ProfileChooser(profile)("attention")
    assert _choices(buckets, (300, 4097, 50000), rows=(1, 8, 16)) == {
        300: ("plain",) * 3, 4097: ("split", "split", "plain"), 50000: ("split", "split", "plain")
    }
    shown = describe_choices(profile)
    assert "from 4096 keys: from 1 rows: split, from 16 rows: plain" in shown
    other = replace(profile, kernels=(replace(attention, buckets=tuple(
        replace(b, variant="plain") if b.min_kv_tokens else b for b in attention.buckets)),))
    diff = diff_profiles(profile, other)
    assert "rows 1     from 4096 keys A split" in diff and diff.endswith("4 bucket(s) differ in choice or coverage")
