"""Which profile applies: user before shipped, exact device -> architecture -> vendor -> engine default."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from pie.poem.lower import ShapeBuckets
from pie.profiles import ProfileError, active_profile, dump_profile, resolve, variant_chooser
from pie.profiles.lookup import user_profile_dir
from pie.hookspecs import hookimpl
from profile_fakes import FakeEngine, make_profile, open_fake, other_device


def write(folder: Path, name: str, **changes: object) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(dump_profile(make_profile(name=name, **changes)))  # type: ignore[arg-type]
    return path


def shipped(name: str, **changes: object) -> str:
    return dump_profile(make_profile(name=name, **changes))  # type: ignore[arg-type]


def test_no_profile_means_engine_defaults(profile_dir: Path) -> None:
    profile, reason = active_profile(open_fake(FakeEngine()))
    assert profile is None
    assert "no profile matches fake:0" in reason and "default variants" in reason


def test_fallback_order_exact_then_architecture_then_vendor(profile_dir: Path) -> None:
    texts = {
        "vendor-only": shipped("vendor-only", device=other_device(name="Other", architecture="acme2")),
        "same-arch": shipped("same-arch", device=other_device(name="Other", vendor="Rival")),
        "exact": shipped("exact"),
        "stranger": shipped("stranger", device=other_device(name="X", vendor="Y", architecture="z")),
    }
    order = ["vendor-only", "same-arch", "exact", "stranger"]
    expectations = [
        ("exact", "the exact device"),
        ("same-arch", "the same architecture"),
        ("vendor-only", "the same vendor"),
    ]
    for expected, level in expectations:
        device = open_fake(FakeEngine(profiles=tuple(texts[n] for n in order)))
        profile, reason = active_profile(device)
        assert profile is not None and profile.name == expected, reason
        assert level in reason and "shipped" in reason
        order.remove(expected)
    profile, reason = active_profile(open_fake(FakeEngine(profiles=(texts["stranger"],))))
    assert profile is None and "default variants" in reason


def test_user_profile_wins_at_equal_closeness(profile_dir: Path) -> None:
    write(profile_dir, "mine")
    device = open_fake(FakeEngine(profiles=(shipped("theirs"),)))
    profile, reason = active_profile(device)
    assert profile is not None and profile.name == "mine"
    assert reason.startswith("your profile 'mine'") and str(profile_dir) in reason


def test_closer_shipped_profile_beats_a_looser_user_profile(profile_dir: Path) -> None:
    write(profile_dir, "mine-vendor", device=other_device(name="Other", architecture="acme2"))
    device = open_fake(FakeEngine(profiles=(shipped("theirs-exact"),)))
    profile, _ = active_profile(device)
    assert profile is not None and profile.name == "theirs-exact"


class WithoutRows(FakeEngine):
    """An engine whose ``rows`` variant cannot be built here, and says why."""

    def __init__(self) -> None:
        super().__init__(kernels={"linear": ("blas",), "add": ("numpy",)})

    @hookimpl
    def pie_unavailable_variants(self, device: object) -> dict[str, str]:
        return {"rows": "row kernels are unavailable: no C compiler found"}


def test_a_profile_measured_with_a_variant_the_engine_cannot_build_here_names_why(
    profile_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The CPU engine without a C compiler: its profile is not wrong, the native kernels are missing."""
    write(profile_dir, "mine")
    write(profile_dir, "old", engine_version="2.4.0")  # wrong whatever the engine can build: rejected
    with caplog.at_level(logging.WARNING, logger="pie.profiles"):
        resolution = resolve(open_fake(WithoutRows()))
    assert resolution.profile is None
    assert "1 file(s) rejected, 1 file(s) not usable here" in resolution.reason
    status = dict((candidate.name, status) for candidate, status in resolution.considered)
    assert status["mine"] == "not usable here: row kernels are unavailable: no C compiler found"
    assert status["old"].startswith("rejected:") and "2.4.0" in status["old"]
    (said,) = [r.getMessage() for r in caplog.records if "mine" in r.getMessage()]
    assert said.startswith("row kernels are unavailable: no C compiler found; so profile mine")
    assert "rejected" not in said


def test_engine_version_mismatch_rejects_the_file(profile_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    write(profile_dir, "old", engine_version="2.4.0")
    with caplog.at_level(logging.WARNING, logger="pie.profiles"):
        resolution = resolve(open_fake(FakeEngine()))
    assert resolution.profile is None
    assert "1 file(s) rejected" in resolution.reason
    ((candidate, status),) = resolution.considered
    assert "measured with fake 2.4.0, but fake 2.5.0 is installed" in status
    line = dump_profile(make_profile()).split("\n").index('engine_version = "2.5.0"') + 1
    assert f"{profile_dir / 'old.toml'}:{line}: engine_version" in status
    assert "old.toml" in caplog.text and "2.4.0" in caplog.text


def test_profile_naming_a_variant_the_engine_lacks_is_rejected(profile_dir: Path) -> None:
    write(profile_dir, "mine")
    engine = FakeEngine(kernels={"linear": ("blas", "tiles"), "add": ("numpy",)}, profiles=(shipped("theirs"),))
    resolution = resolve(open_fake(engine))
    statuses = dict((c.name, s) for c, s in resolution.considered)
    assert "no variant 'rows' of linear" in statuses["mine"]
    assert resolution.profile is None


def test_broken_user_file_is_skipped_whole(profile_dir: Path) -> None:
    good = write(profile_dir, "b-good")
    bad = profile_dir / "a-bad.toml"
    bad.write_text(good.read_text().replace("rows = 2\n", "rows = 3\n"))
    resolution = resolve(open_fake(FakeEngine()))
    assert resolution.profile is not None and resolution.profile.name == "b-good"
    statuses = dict((c.source, s) for c, s in resolution.considered)
    assert "3 is not a power of two" in statuses[str(bad)]


def test_profile_for_another_engine_is_not_a_candidate(profile_dir: Path) -> None:
    write(profile_dir, "gpu-one", engine="vulkan")
    resolution = resolve(open_fake(FakeEngine()))
    assert resolution.profile is None
    assert resolution.considered[0][1] == "for engine 'vulkan'"


def test_profile_path_lists_files_and_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    single = write(tmp_path, "single", device=other_device(name="Other"))
    write(second, "exact")
    monkeypatch.setenv("PIE_PROFILE_PATH", os.pathsep.join([str(first), str(single), str(second)]))
    monkeypatch.delenv("PIE_PROFILE", raising=False)
    resolution = resolve(open_fake(FakeEngine()))
    assert [c.name for c, _ in resolution.considered] == ["single", "exact"]
    assert resolution.profile is not None and resolution.profile.name == "exact"
    assert user_profile_dir() == first


def test_forcing_a_profile_or_none(profile_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(profile_dir, "mine")
    device = open_fake(FakeEngine(profiles=(shipped("theirs"),)))
    monkeypatch.setenv("PIE_PROFILE", "none")
    assert active_profile(device)[0] is None
    monkeypatch.setenv("PIE_PROFILE", "theirs")
    profile, reason = active_profile(device)
    assert profile is not None and profile.name == "theirs" and "PIE_PROFILE=theirs" in reason
    monkeypatch.setenv("PIE_PROFILE", "nobody")
    with pytest.raises(ProfileError, match=f"PIE_PROFILE=nobody: the {device.name} engine has no profile of that name "
                                           r"\(`pie profile list` shows each profile's engine"):
        active_profile(device)
    old = write(profile_dir.parent, "old", engine_version="1.0")
    monkeypatch.setenv("PIE_PROFILE", str(old))
    with pytest.raises(ProfileError, match="cannot apply to fake:0"):
        active_profile(device)
    damaged = profile_dir.parent / "damaged.toml"
    damaged.write_text('name = "x"\n[[kernel\n')
    monkeypatch.setenv("PIE_PROFILE", str(damaged))
    with pytest.raises(ProfileError) as refused:  # the path once, then the line at fault: it was said three times
        active_profile(device)
    assert str(refused.value).startswith(f"PIE_PROFILE={damaged} cannot apply to fake:0: {damaged}:2: not valid TOML")


def test_variant_chooser_gives_buckets_only_where_a_variant_wins(profile_dir: Path) -> None:
    write(profile_dir, "mine")
    chooser, _ = variant_chooser(open_fake(FakeEngine()))
    assert chooser is not None
    assert chooser("linear") == ShapeBuckets(((4096, 1, "rows"), (4096, 2, "rows"), (4096, 4, "rows")))
    assert chooser("add") is None
    write(profile_dir, "mine", choice="blas")
    chooser, _ = variant_chooser(open_fake(FakeEngine()))
    assert chooser is not None and chooser("linear") is None


def test_profiles_the_cpu_engine_ships_load_and_fit() -> None:
    pytest.importorskip("pie_engine_cpu")
    from pie.plugins import EngineRegistry
    from pie.profiles import check_fits
    from pie.profiles.lookup import engine_candidates

    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    candidates = engine_candidates(device.engine)
    assert candidates, "the CPU engine ships no profile"
    for candidate in candidates:
        assert candidate.profile is not None, candidate.error
        check_fits(candidate.profile, "cpu", device.engine.version, device.kernels())
        assert candidate.profile.tune.load_average is not None  # measured here, with the conditions recorded


class OddProfiles(FakeEngine):
    """Gives ``given`` for its shipped profiles."""

    def __init__(self, given: object) -> None:
        super().__init__()
        self.given = given

    @hookimpl
    def pie_device_profiles(self) -> object:
        return self.given


@pytest.mark.parametrize(
    ("given", "what"),
    [([42, None], "gave 'int' among its profiles"), (7, "gave its profiles as 'int'"),
     (shipped("one"), "gave its profiles as 'str'")],
)
def test_profiles_an_engine_gives_that_are_not_text_are_rejected_naming_it(
    profile_dir: Path, given: object, what: str
) -> None:
    """A list holding a number crashed every command that looks profiles up (TypeError), for every engine."""
    write(profile_dir, "mine")
    device = open_fake(OddProfiles(given))
    resolution = resolve(device)
    assert resolution.profile is not None and resolution.profile.name == "mine"
    (rejected,) = [status for _, status in resolution.considered if status.startswith("rejected")]
    assert f"engine 'fake' {what}" in rejected
