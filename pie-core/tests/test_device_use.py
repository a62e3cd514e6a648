"""Claims on a device by `pie serve` and `pie tune`, and the notes each prints when it shares a device."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pie.contract import DeviceInfo
from pie.device_use import DeviceClaim, DeviceUser, claims_dir, device_name, device_users

CPU = DeviceInfo("cpu", 0, "host", "", "", "cpu", 0)
LAVAPIPE = DeviceInfo("vulkan", 0, "llvmpipe", "Mesa", "", "cpu", 0)
GPU = DeviceInfo("vulkan", 1, "a GPU", "", "", "gpu", 0)

HOLDER = """
import sys
from pathlib import Path
from pie.contract import DeviceInfo
from pie.device_use import DeviceClaim
folder = Path(sys.argv[2]) if len(sys.argv) > 2 else None
claim = DeviceClaim(DeviceInfo("cpu", 0, "host", "", "", "cpu", 0), sys.argv[1], folder)
print(claim.held, flush=True)
sys.stdin.read()
"""


class Holder:
    """Another process holding a claim on the host CPU until stopped."""

    def __init__(self, role: str, folder: Path | None = None) -> None:
        args = [sys.executable, "-c", HOLDER, role] + ([] if folder is None else [str(folder)])
        self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "True"
        self.user = DeviceUser(self.process.pid, role)

    def stop(self, sig: int | None = None) -> None:
        if sig is not None:
            self.process.send_signal(sig)
        else:
            assert self.process.stdin is not None
            self.process.stdin.close()
        self.process.wait(30)


@pytest.fixture
def holder(request: pytest.FixtureRequest) -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for one in started:
        if one.process.poll() is None:
            one.process.kill()
            one.process.wait(30)


def test_another_process_s_claim_is_seen_while_it_lives_and_removed_once_it_is_killed(
    tmp_path: Path, holder: list[Holder]
) -> None:
    serve = Holder("serve", tmp_path)
    holder.append(serve)
    assert device_users(CPU, tmp_path) == [serve.user]
    assert device_users(LAVAPIPE, tmp_path) == [serve.user], "every CPU-kind device is the host's CPU"
    assert device_users(GPU, tmp_path) == []
    serve.stop(signal.SIGKILL)
    assert device_users(CPU, tmp_path) == []
    assert list(tmp_path.iterdir()) == [], "a dead process's claim is removed by whoever finds it"


def test_this_process_s_own_claims_are_not_listed_and_release_removes_them(tmp_path: Path) -> None:
    with DeviceClaim(GPU, "tune", tmp_path) as claim:
        assert claim.held and claim.path is not None and claim.path.parent == tmp_path
        assert claim.path.name.startswith(f"{device_name(GPU)}.{os.getpid()}.tune.")
        assert device_users(GPU, tmp_path) == []
    assert not claim.held and list(tmp_path.iterdir()) == []
    claim.release()


def test_a_folder_that_cannot_be_made_or_read_gives_a_claim_that_holds_nothing(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    claim = DeviceClaim(CPU, "serve", blocked / "claims")
    assert not claim.held
    claim.release()
    assert device_users(CPU, blocked / "claims") == []


def test_names_that_are_not_claims_are_passed_over(tmp_path: Path) -> None:
    for name in ("cpu.notapid.serve.x", "cpu.12.unknown.x", "cpu.12.serve", ".cpu.12.serve.x", "cpu-0.1.serve.x"):
        (tmp_path / name).write_text("")
    (tmp_path / "cpu.1.serve.folder").mkdir()
    assert device_users(CPU, tmp_path) == []


def test_a_claim_s_role_is_checked() -> None:
    with pytest.raises(ValueError, match="one of serve, tune"):
        DeviceClaim(CPU, "bench")


def test_a_tune_says_that_a_server_uses_its_device(holder: list[Holder], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pie_engine_cpu")
    from pie.cli import app
    from typer.testing import CliRunner

    monkeypatch.setenv("PIE_PROFILE_PATH", str(tmp_path))
    monkeypatch.setenv("PIE_ENGINES", "cpu")
    monkeypatch.setenv("COLUMNS", "200")
    serve = Holder("serve")
    holder.append(serve)
    result = CliRunner().invoke(app, ["tune", "--engine", "cpu", "--budget", "1", "--name", "shared"])
    assert result.exit_code == 0, result.output
    assert f"note: a `pie serve` (process {serve.user.pid}) also uses this device (cpu:0, the host CPU)" in result.output
    assert not [path for path in claims_dir().glob(f"cpu.{os.getpid()}.*")], "the tune's own claim is gone"
    serve.stop()
    quiet = CliRunner().invoke(app, ["tune", "--engine", "cpu", "--budget", "1", "--name", "shared"])
    assert quiet.exit_code == 0, quiet.output
    assert "also uses this device" not in quiet.output


def test_a_server_says_that_a_tune_measures_on_its_device_and_claims_it_while_it_serves(
    holder: list[Holder], tmp_path: Path
) -> None:
    pytest.importorskip("fastapi", reason="pie serve needs the serve extra")
    from pie.testing.models import make_gguf_model
    from pie.testing.serve_process import ServeProcess, wait_until

    model = make_gguf_model(tmp_path / "tiny.gguf", "F32")
    tune = Holder("tune")
    holder.append(tune)
    with ServeProcess("--model", str(model)) as server:
        server.wait_ready()
        assert wait_until(lambda: "is measuring on this device" in server.log), server.log
        assert f"note: a `pie tune` (process {tune.user.pid}) is measuring on this device (cpu:0)" in server.log
        served = DeviceUser(server.process.pid, "serve")
        assert served in device_users(CPU)
        assert server.stop() == 0
    assert served not in device_users(CPU)
    assert not list(claims_dir().glob(f"cpu.{served.pid}.*")), "the server removed its claim as it stopped"


def test_pie_device_claims_dir_names_the_folder_processes_share(holder: list[Holder], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIE_DEVICE_CLAIMS_DIR", str(tmp_path / "shared"))
    serve = Holder("serve")  # its claim goes where the variable it inherits says
    holder.append(serve)
    assert claims_dir() == tmp_path / "shared"
    assert [p.name.split(".")[:3] for p in (tmp_path / "shared").iterdir()] == [["cpu", str(serve.user.pid), "serve"]]
    assert device_users(CPU) == [serve.user]
    monkeypatch.setenv("PIE_DEVICE_CLAIMS_DIR", str(tmp_path / "another"))
    assert device_users(CPU) == [], "a process with another folder sees no claim"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PIE_DEVICE_CLAIMS_DIR", "~/shared")
    assert claims_dir() == tmp_path / "shared" and device_users(CPU) == [serve.user]
