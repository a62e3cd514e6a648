"""pie's own files (`pie.files`): every state file is read only when it is a regular file, and only up to its
bound; a write goes through a temporary file of its own, removed when the write fails, and never replaces
a folder, device or FIFO.

Each reader of a state file is checked against a FIFO (a read would wait forever for a writer) and a link to
/dev/zero (a read would never end) in a child process of its own, with a cap on its memory and time, so that
a reader that reads them anyway fails the test instead of hanging it or eating the machine's memory."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pie.files import (
    FileTooLargeError,
    NotRegularFileError,
    non_regular_kind,
    read_regular_file,
    user_temporary_folder,
    write_atomically,
)

MEMORY_CAP = 1 << 30
"""The child's address space: far more than pie needs to read a state file, far less than /dev/zero offers."""


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _endless(path: Path) -> None:
    path.symlink_to("/dev/zero")


NON_REGULAR: list[Callable[[Path], None]] = [_fifo, _endless]


def _bounded_child(code: str, *arguments: str, env: dict[str, str] | None = None) -> str:
    """Run ``code`` (with ``sys.argv[1:]`` = ``arguments``) in a new interpreter whose memory is capped, and
    return what it printed; a child that blocks is killed by the timeout, which fails the test."""
    capped = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_CAP}, {MEMORY_CAP}))\n{code}"
    run = subprocess.run([sys.executable, "-c", capped, *arguments], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert run.returncode == 0, f"the reader failed ({run.returncode}):\n{run.stderr[-3000:]}"
    return run.stdout


# -- the helpers ------------------------------------------------------------------


def test_a_regular_file_is_read_and_anything_else_refused_without_waiting(tmp_path: Path) -> None:
    regular = tmp_path / "state.json"
    regular.write_bytes(b"{}")
    assert read_regular_file(regular, 2) == b"{}"
    with pytest.raises(FileTooLargeError, match="2 bytes, more than the 1"):
        read_regular_file(regular, 1)
    for make in NON_REGULAR:
        path = tmp_path / make.__name__
        make(path)
        with pytest.raises(NotRegularFileError, match=r"not a regular file \(a (FIFO|character device)\)"):
            read_regular_file(path, 1 << 20)
    with pytest.raises(NotRegularFileError, match=r"\(a folder\)"):
        read_regular_file(tmp_path, 1 << 20)
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "absent", 1)


def test_a_small_file_is_read_under_a_memory_limit_far_below_the_bound(tmp_path: Path) -> None:
    """The bound is what a file may hold, not what a read takes: a compile cache entry's (1 GiB) was allocated
    whole for every read, a MemoryError under `ulimit -v` of a GiB."""
    path = tmp_path / "small"
    path.write_bytes(b"x" * 1000)
    code = "import sys\nfrom pie.files import read_regular_file\nprint(len(read_regular_file(sys.argv[1], 4 << 30)))"
    assert _bounded_child(code, str(path)).strip() == "1000"


def test_a_file_that_grows_while_read_is_still_bounded(tmp_path: Path) -> None:
    path = tmp_path / "growing"
    path.write_bytes(b"x" * 10)
    real_fstat = os.fstat

    def fstat_then_grow(descriptor: int) -> os.stat_result:
        status = real_fstat(descriptor)
        with path.open("ab") as more:
            more.write(b"y" * 100)
        return status

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fstat", fstat_then_grow)
        assert read_regular_file(path, 200) == b"x" * 10 + b"y" * 100
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fstat", fstat_then_grow)
        with pytest.raises(FileTooLargeError):
            read_regular_file(path, 150)


@pytest.mark.parametrize("make", [*NON_REGULAR, Path.mkdir], ids=["fifo", "link-to-dev-zero", "folder"])
def test_a_write_never_replaces_what_is_not_a_regular_file(tmp_path: Path, make: Callable[[Path], None]) -> None:
    path = tmp_path / "target"
    make(path)
    kind = non_regular_kind(path)
    assert kind in ("a FIFO", "a character device", "a folder")
    with pytest.raises(NotRegularFileError, match=f"{kind}, not a regular file"):
        write_atomically(path, "text")
    assert non_regular_kind(path) == kind and os.listdir(tmp_path) == ["target"], "replaced, or a file left beside it"


def test_concurrent_writers_each_write_whole_through_their_own_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.toml"
    (tmp_path / "profile.toml.tmp").mkdir()  # where a fixed temporary name would have had to go
    payloads = [str(index).encode() * 50_000 for index in range(8)]
    failures: list[BaseException] = []

    def write(payload: bytes) -> None:
        try:
            for _ in range(20):
                write_atomically(path, payload)
                assert path.read_bytes() in payloads
        except BaseException as exc:
            failures.append(exc)

    writers = [threading.Thread(target=write, args=(payload,)) for payload in payloads]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert not failures, failures
    assert path.read_bytes() in payloads
    assert sorted(os.listdir(tmp_path)) == ["profile.toml", "profile.toml.tmp"], "a temporary file was left"


def test_a_write_cut_short_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    """`ulimit -f`: the write fails with EFBIG (Python ignores SIGXFSZ); a full disk fails alike, with ENOSPC."""
    path = tmp_path / "profile.toml"
    path.write_text("old")
    code = (
        "import resource, sys\n"
        "from pie.files import write_atomically\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    write_atomically(sys.argv[1], b'x' * 100_000)\n"
        "except OSError as exc:\n"
        "    print(exc.errno, exc.filename)\n"
    )
    errno_number, filename = _bounded_child(code, str(path)).split()
    assert int(errno_number) == errno.EFBIG and Path(filename).parent == tmp_path  # on the temporary file
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["profile.toml"]


def test_a_write_is_synced_before_its_rename_and_its_folder_after(tmp_path: Path, monkeypatch) -> None:
    """The order that makes a rename last a power loss with the new bytes behind it, not an empty file."""
    path, payload = tmp_path / "profile.toml", b"x" * 10_000
    path.write_text("old")
    events: list[tuple[str, ...]] = []
    sync, replace = os.fsync, os.replace

    def recording_fsync(descriptor: int) -> None:
        found = os.fstat(descriptor)
        what = "folder" if stat.S_ISDIR(found.st_mode) else f"file of {found.st_size} bytes"
        events.append(("fsync", what, "old still there" if path.read_text() == "old" else "replaced"))
        sync(descriptor)

    def recording_replace(source: str, target: str) -> None:
        events.append(("replace",))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    write_atomically(path, payload)
    assert path.read_bytes() == payload
    expected = [("fsync", "file of 10000 bytes", "old still there"), ("replace",), ("fsync", "folder", "replaced")]
    assert events == (expected[:2] if os.name == "nt" else expected)


@pytest.mark.skipif(os.name == "nt", reason="Windows: a folder is not synced")
@pytest.mark.parametrize(("error", "fails"), [(errno.EINVAL, False), (errno.EIO, True)], ids=["einval", "eio"])
def test_a_folder_that_cannot_be_synced_leaves_the_write_done(tmp_path: Path, monkeypatch, error: int,
                                                              fails: bool) -> None:
    """A file system that does not sync folders (EINVAL) is no failure; a disk that fails the sync (EIO) is one,
    naming the folder. The file is replaced either way."""
    path, sync = tmp_path / "profile.toml", os.fsync

    def folder_fails(descriptor: int) -> None:
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise OSError(error, os.strerror(error))
        sync(descriptor)

    monkeypatch.setattr(os, "fsync", folder_fails)
    if fails:
        with pytest.raises(OSError) as raised:
            write_atomically(path, "new")
        assert raised.value.errno == error and raised.value.filename == str(tmp_path)
    else:
        write_atomically(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["profile.toml"]


# -- every reader of a state file -------------------------------------------------


@pytest.mark.parametrize("make", NON_REGULAR, ids=["fifo", "link-to-dev-zero"])
def test_a_profile_that_is_not_a_regular_file_is_rejected_unread(tmp_path: Path, make: Callable[[Path], None]) -> None:
    folder = tmp_path / "profiles"
    folder.mkdir()
    make(folder / "x.toml")
    code = (
        "import sys\n"
        "from pie.profiles.lookup import user_candidates\n"
        "(candidate,) = user_candidates({'PIE_PROFILE_PATH': sys.argv[1]})\n"
        "print(candidate.error)\n"
    )
    assert "x.toml: cannot read: not a regular file" in _bounded_child(code, str(folder))


@pytest.mark.parametrize("make", NON_REGULAR, ids=["fifo", "link-to-dev-zero"])
def test_a_probe_cache_that_is_not_a_regular_file_is_ignored_and_left(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    path = tmp_path / "probes.json"
    make(path)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pie.probe_cache import Probe, ProbeCache\n"
        "cache = ProbeCache(Path(sys.argv[1]))\n"
        "cache.put('k', Probe(None, error='x'))\n"
        "print(ProbeCache(Path(sys.argv[1])).get('k'))\n"
    )
    assert _bounded_child(code, str(path)).strip() == "None", "it was written after all"
    assert non_regular_kind(path) in ("a FIFO", "a character device"), "replaced"


@pytest.mark.parametrize("make", NON_REGULAR, ids=["fifo", "link-to-dev-zero"])
def test_a_compile_cache_entry_that_is_not_a_regular_file_is_compiled_again(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    key = "ab" + "0" * 62
    (tmp_path / "ab").mkdir()
    make(tmp_path / "ab" / f"{key}.bin")
    make(tmp_path / "ab" / f"{key}.so")
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pie.enginekit.compile_cache import CompileCache\n"
        "cache = CompileCache('demo', Path(sys.argv[1]))\n"
        "path = cache.file(sys.argv[2], 'so', lambda: {'so': b'library'})\n"
        "print(path.read_bytes().decode(), cache.stats.misses)\n"
    )
    (tmp_path / "tmp").mkdir()  # where the cache turns, as it cannot replace the entry
    assert _bounded_child(code, str(tmp_path), key, env={"TMPDIR": str(tmp_path / "tmp")}).split() == ["library", "1"]


@pytest.mark.parametrize("make", NON_REGULAR, ids=["fifo", "link-to-dev-zero"])
def test_a_model_record_that_is_not_a_regular_file_is_a_damaged_entry(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    entry = tmp_path / "models" / "mine"
    entry.mkdir(parents=True)
    (entry / "mine.gguf").write_bytes(b"GGUF")
    make(entry / ".pie-manifest.json")
    code = "from pie.model.store import find_model\nprint(find_model('mine').problem)\n"
    said = _bounded_child(code, env={"PIE_MODEL_DIR": str(tmp_path / "models")})
    assert ".pie-manifest.json cannot be read (not a regular file" in said


def test_a_users_temporary_folder_is_made_private_once_and_found_again(system_tmp: Path) -> None:
    assert user_temporary_folder("demo", create=False) is None and not any(system_tmp.iterdir())
    folder = user_temporary_folder("demo")
    assert folder == system_tmp / f"pie-demo-{os.getuid()}"
    assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700
    (folder / "kept").write_text("built")
    assert user_temporary_folder("demo") == user_temporary_folder("demo", create=False) == folder
    assert (folder / "kept").read_text() == "built"


@pytest.mark.parametrize("made", ["by another user", "open to the group", "open to all", "a link", "a file"])
def test_a_users_temporary_folder_someone_else_could_have_made_is_refused(
    system_tmp: Path, monkeypatch: pytest.MonkeyPatch, made: str
) -> None:
    """Anyone may make a name in a shared temporary folder first: such a folder (or link) is never used."""
    uid = os.getuid()
    if made == "by another user":  # made by this test's user, in the name of the user this process then is
        uid += 1
        monkeypatch.setattr(os, "getuid", lambda: uid)
    name = system_tmp / f"pie-demo-{uid}"
    if made == "a link":
        (system_tmp / "elsewhere").mkdir(mode=0o700)
        name.symlink_to(system_tmp / "elsewhere")
    elif made == "a file":
        name.write_text("")
    else:
        name.mkdir()
        name.chmod({"open to the group": 0o770, "open to all": 0o777}.get(made, 0o700))
    assert user_temporary_folder("demo") is None and user_temporary_folder("demo", create=False) is None
