"""The inferlet sandbox, tried as a hostile inferlet would: every attempt runs in its own child process.

Each child (``sandbox_child.py``) imports what a worker imports, locks itself down and then tries one thing.
The pytest process itself is never locked down. A test needs the layers that stop its attempt; it skips,
with the probe's reason, only where this machine cannot apply one of them.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import pie
from pie.inferlet import sandbox
from pie.inferlet.sandbox import (
    LAYERS,
    LayerStatus,
    SandboxPolicy,
    describe_layers,
    probe_layers,
    python_paths,
)

CHILD = Path(__file__).with_name("sandbox_child.py")
SECRET = "sk-pie-test-secret"
TIMEOUT_S = 60
PIE_SRC = str(Path(pie.__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def layers() -> dict[str, LayerStatus]:
    return probe_layers()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir(mode=0o700)
    return path


def need(layers: dict[str, LayerStatus], *names: str) -> None:
    for name in names:
        if not layers[name].available:
            pytest.skip(f"sandbox layer {name} is unavailable here: {layers[name].detail}")


def landlock_abi(layers: dict[str, LayerStatus]) -> int:
    match = re.match(r"ABI (\d+)", layers["landlock"].detail)
    return int(match.group(1)) if layers["landlock"].available and match else 0


def child(case: str, workdir: Path, probed: dict[str, LayerStatus], arg: str = "", popen: bool = False, **policy):
    """Run ``case`` in a locked-down child; by default every layer this machine has is required."""
    pass_fds = policy.pop("pass_fds", ())
    settings = {"workdir": str(workdir), "memory_bytes": 2**30, **policy}
    settings.setdefault("required", [n for n in settings.get("layers", LAYERS) if probed[n].available])
    pythonpath = os.pathsep.join(p for p in (PIE_SRC, os.environ.get("PYTHONPATH")) if p)
    env = {"PIE_API_KEY": SECRET, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    command = [sys.executable, str(CHILD), case, json.dumps(settings), arg]
    kwargs = dict(env=env, cwd=workdir.parent, text=True, pass_fds=pass_fds)
    if popen:
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    return subprocess.run(command, capture_output=True, timeout=TIMEOUT_S, **kwargs)


def said(done: subprocess.CompletedProcess, probed: dict[str, LayerStatus], **policy) -> dict[str, str]:
    """The child's lines after its ``layers:`` line, keyed by first word; checks the layers it reported."""
    out = done.stdout.splitlines()
    assert out and out[0].startswith("layers: "), (done.returncode, done.stdout, done.stderr)
    wanted = [n for n in policy.get("layers", LAYERS) if probed[n].available]
    assert out[0].split()[1] == ",".join(wanted)
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] if " " in line else "" for line in out[1:]}


# ---------------------------------------------------------------- the probe and the policy


def test_probe_reports_every_layer_with_a_reason(layers):
    assert list(layers) == list(LAYERS)
    for name, status in layers.items():
        assert status.name == name and status.detail, status
    line = describe_layers(layers)
    print(line)  # what pie serve prints at start-up
    active = [name for name, status in layers.items() if status.available]
    assert line.startswith(f"sandbox layers active: {', '.join(active) or 'none'}")
    for name, status in layers.items():
        if not status.available:
            assert f"{name} ({status.detail})" in line


def test_probe_leaves_this_process_alone(layers):
    assert "PATH" in os.environ or os.environ  # our environment is still there
    with open("/etc/passwd") as passwd:
        assert passwd.read()
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as status:
            assert "Seccomp:\t0" in status.read()


def test_probe_on_this_linux_finds_the_kernel_layers(layers):
    """Linux 5.13+ with Landlock: a failure here means the probe, not the kernel, went wrong."""
    if not sys.platform.startswith("linux"):
        for name in ("namespaces", "no_capabilities", "no_new_privs", "landlock", "seccomp"):
            assert not layers[name].available and "Linux only" in layers[name].detail
        return
    for name in ("rlimits", "no_core_dumps", "empty_environment", "private_workdir", "no_capabilities", "no_new_privs"):
        assert layers[name].available, layers[name]
    # Where the kernel has seccomp and Landlock, a missing binding or library is a failure, not a skip.
    with open("/proc/self/status") as status:
        if "Seccomp:" in status.read():
            assert layers["seccomp"].available, layers["seccomp"]
    try:
        abi = sandbox._landlock_abi()  # only asks the kernel for its version
    except sandbox._Unavailable as exc:
        assert not layers["landlock"].available and str(exc) == layers["landlock"].detail
    else:
        assert layers["landlock"].available and layers["landlock"].detail.startswith(f"ABI {abi}:")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"workdir": "relative/dir"}, "absolute"),
        ({"workdir": "/tmp/x", "cpu_seconds": 0}, "cpu_seconds must be positive"),
        ({"workdir": "/tmp/x", "required": frozenset({"seccomp", "moat"})}, "unknown sandbox layers"),
        ({"workdir": "/tmp/x", "layers": frozenset({"rlimits"}), "required": frozenset({"seccomp"})}, "left off"),
        ({"workdir": "/tmp/x", "read_only_paths": ("/usr", "/")}, "whole filesystem"),
    ],
)
def test_policy_refuses_nonsense(settings, message):
    with pytest.raises(ValueError, match=message):
        SandboxPolicy(**settings)


def test_policy_requires_the_layers_it_applies():
    assert SandboxPolicy(workdir="/tmp/x").required == frozenset(LAYERS)
    assert SandboxPolicy(workdir="/tmp/x", layers=frozenset({"rlimits"})).required == frozenset({"rlimits"})


def test_python_paths_cover_the_installation_and_not_the_current_directory():
    paths = python_paths()
    assert list(paths) == sorted(set(paths))
    for a in paths:
        assert a != "/" and os.path.exists(a)
        assert not any(b != a and a.startswith(os.path.join(b, "")) for b in paths), f"{a} lies inside another"

    def covered(path: str) -> bool:
        real = os.path.realpath(path)
        return any(real == p or real.startswith(os.path.join(p, "")) for p in paths)

    assert covered(os.__file__) and covered(pie.__file__) and covered(json.__file__)
    import numpy

    assert covered(numpy.__file__)
    assert os.path.realpath(os.getcwd()) not in paths


# ---------------------------------------------------------------- no new programs, no new processes


def test_os_system_starts_no_shell(workdir, layers):
    need(layers, "seccomp")
    done = child("system", workdir, layers)
    lines = said(done, layers)
    assert os.waitstatus_to_exitcode(int(lines["system"])) == 127  # glibc: the shell could not be spawned
    assert "hi" not in done.stdout.split()


def test_subprocess_is_refused(workdir, layers):
    need(layers, "seccomp")
    assert said(child("subprocess", workdir, layers), layers)["subprocess"] == "EPERM"


def test_execv_is_refused(workdir, layers):
    need(layers, "seccomp")
    assert said(child("execv", workdir, layers), layers)["execv"] == "EPERM"


def test_fork_is_refused(workdir, layers):
    need(layers, "seccomp")
    assert said(child("fork", workdir, layers), layers)["fork"] == "EPERM"


def test_fork_bomb_forks_nothing_and_threads_still_start(workdir, layers):
    need(layers, "seccomp")
    lines = said(child("fork_bomb", workdir, layers), layers)
    assert lines["fork_bomb"] == "0 EPERM"
    assert lines["thread"] == "True"


# ---------------------------------------------------------------- the filesystem


def test_reads_nothing_outside_the_python_installation(workdir, layers):
    need(layers, "landlock")
    lines = said(child("read_passwd", workdir, layers), layers)
    assert lines["read"] == lines["list"] == lines["proc"] == "EACCES"


def test_writes_only_inside_its_private_directory(workdir, layers):
    need(layers, "landlock", "private_workdir")
    outside = workdir.parent / "escaped.txt"
    lines = said(child("write", workdir, layers, str(outside)), layers)
    assert lines["outside"] == lines["mkdir_outside"] == "EACCES"
    assert not outside.exists() and not Path(f"{outside}.dir").exists()
    assert lines["inside"] == f"inside {workdir / 'sub' / 'inside.txt'}"
    assert lines["cwd"] == str(workdir)
    if layers["namespaces"].available:  # it wrote into a folder of its own mount namespace, gone with it
        assert not any(workdir.iterdir())
    else:
        assert (workdir / "sub" / "inside.txt").read_text() == "inside"


@pytest.mark.parametrize("case", ["fill", "fill_without_sys_admin"])
def test_what_it_writes_is_bounded_in_total_and_the_host_never_sees_its_folder(workdir, layers, case):
    """RLIMIT_FSIZE bounds one file: a worker wrote 256 MiB files one after another until the host's disk was full.
    Without CAP_SYS_ADMIN (a container's root, or any user) the folder is mounted in the worker's user namespace."""
    need(layers, "namespaces", "private_workdir")
    if case.endswith("without_sys_admin") and os.geteuid() != 0:
        pytest.skip("only root can drop CAP_SYS_ADMIN alone here; as this user the namespaces are a user's already")
    lines = said(child(case, workdir, layers, folder_bytes=2**20, folder_files=64), layers)
    assert lines["bytes"].startswith("ENOSPC ") and 2**20 - 65536 <= int(lines["bytes"].split()[1]) <= 2**20
    assert lines["files"].startswith("ENOSPC ") and int(lines["files"].split()[1]) < 64
    assert lines["cwd"] == str(workdir)
    with open("/proc/self/mountinfo") as mounts:
        assert str(workdir) not in mounts.read()
    assert not any(workdir.iterdir())


def test_cannot_change_modes_or_times_outside(workdir, layers):
    need(layers, "seccomp")
    target = workdir.parent / "target.txt"
    target.write_text("mine")
    target.chmod(0o644)
    before = target.stat()
    lines = said(child("chmod", workdir, layers, str(target)), layers)
    assert lines["chmod"] == lines["utime"] == "EPERM"
    after = target.stat()
    assert stat.S_IMODE(after.st_mode) == 0o644 and after.st_mtime_ns == before.st_mtime_ns


# ---------------------------------------------------------------- the network


@pytest.mark.parametrize(
    "only, expected",
    [
        (None, "EPERM"),  # every layer: seccomp refuses the socket first
        ("seccomp", "EPERM"),
        ("namespaces", "ENETUNREACH"),  # a fresh namespace's loopback is down
        ("landlock", "EACCES"),  # ABI 4: TCP connect handled, no rule allows it
    ],
)
def test_connect_to_a_loopback_listener_never_arrives(workdir, layers, only, expected):
    if only:
        need(layers, only)
    else:
        need(layers, "seccomp")
    if only == "landlock" and landlock_abi(layers) < 4:
        pytest.skip(f"Landlock refuses TCP from ABI 4, this kernel has {layers['landlock'].detail}")
    policy = {"layers": [only]} if only else {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        lines = said(child("connect", workdir, layers, str(port), **policy), layers, **policy)
        assert lines["connect"] == expected
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # the listener saw no connection


def test_network_true_keeps_the_network(workdir, layers):
    """The control for the test above: with the network allowed, the listener does see the child."""
    need(layers, "seccomp")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        lines = said(child("connect", workdir, layers, str(port), network=True), layers)
        assert lines["connect"] == "ALLOWED"
        listener.settimeout(5)
        connection, _ = listener.accept()
        connection.close()


# ---------------------------------------------------------------- environment, signals, descriptors


def test_environment_is_empty_and_the_api_key_gone(workdir, layers):
    need(layers, "empty_environment", "landlock")
    lines = said(child("environ", workdir, layers, environment={"PIE_WORKER": "1"}), layers)
    assert json.loads(lines["environ"]) == {
        "os.environ": {"PIE_WORKER": "1"},
        "getenv": None,
        "posix.environ": False,
        "block": False,  # the bytes exec left on the stack, what /proc/PID/environ shows, are zeroed
    }
    assert lines["proc_environ"] == "EACCES"


def test_signals_reach_only_itself(workdir, layers):
    need(layers, "seccomp")
    lines = said(child("kill", workdir, layers), layers)
    assert lines["kill"] == "EPERM" and lines["self"] == "ok"


@pytest.mark.parametrize("only_seccomp", [True, False], ids=["seccomp_alone", "every_layer_but_landlock"])
def test_no_signal_owner_can_be_set_so_sigio_kills_nothing(workdir, layers, only_seccomp):
    """A socket's SIGIO goes to its owner, with the signal F_SETSIG chose, checked only against the uid that set the
    owner (root's reaches any process). Before Landlock ABI 6 (Linux 6.12) scopes signals, seccomp alone stands
    between a worker and SIGKILL for the server: Landlock is left off here, as on such a kernel."""
    need(layers, "seccomp")
    policy = {"layers": ["seccomp"] if only_seccomp else [n for n in LAYERS if n != "landlock"]}
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lines = said(child("sigio", workdir, layers, str(victim.pid), **policy), layers, **policy)
        with pytest.raises(subprocess.TimeoutExpired):
            victim.wait(timeout=0.5)
    finally:
        victim.kill()
        victim.wait()
    for name in ("F_SETOWN", "F_SETOWN_EX", "FIOSETOWN", "SIOCSPGRP", "F_SETOWN_high_bits", "F_SETSIG", "F_SETLEASE"):
        assert lines[name] == "EPERM", (name, lines)


def test_landlock_alone_scopes_signals(workdir, layers):
    need(layers, "landlock")
    if landlock_abi(layers) < 6:
        pytest.skip(f"Landlock scopes signals from ABI 6, this kernel has {layers['landlock'].detail}")
    lines = said(child("kill", workdir, layers, layers=["landlock"]), layers, layers=["landlock"])
    assert lines["kill"] == "EPERM" and lines["self"] == "ok"


def test_no_file_system_watch(workdir, layers):
    """inotify answers for any folder, Landlock or not: a worker watched /tmp, other workers' folders and /root, and
    saw files made, opened and read there, under names it could not list."""
    need(layers, "seccomp")
    lines = said(child("inotify", workdir, layers, str(workdir.parent)), layers)
    for call in ("inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init"):
        assert lines[call] == "EPERM", (call, lines)


def test_keep_fds_closes_every_other_descriptor(workdir, layers):
    keep_r, keep_w = os.pipe()
    drop_r, drop_w = os.pipe()
    try:
        arg = json.dumps({"keep": keep_w, "drop": drop_w})
        done = child("fds", workdir, layers, arg, keep_fds=[keep_w], pass_fds=(keep_w, drop_w))
        lines = said(done, layers)
        assert lines["kept"] == "ALLOWED" and lines["dropped"] == "EBADF"
        assert os.read(keep_r, 16) == b"kept"
    finally:
        for fd in (keep_r, keep_w, drop_r, drop_w):
            os.close(fd)


def test_kernel_reports_no_capabilities_no_new_privs_seccomp_and_own_namespaces(workdir, layers):
    """Without Landlock the child may read its own /proc/self/status: the kernel's account of it."""
    policy = {"layers": ["namespaces", "no_capabilities", "no_new_privs", "seccomp"]}
    need(layers, *policy["layers"])
    lines = said(child("status", workdir, layers, **policy), layers, **policy)
    for field in ("CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"):
        assert int(lines[field], 16) == 0, (field, lines[field])
    assert lines["NoNewPrivs:"] == "1"
    assert lines["Seccomp:"] == "2"  # filter mode
    assert lines["netns"] != os.readlink("/proc/self/ns/net")
    assert lines["ipcns"] != os.readlink("/proc/self/ns/ipc")
    assert lines["setuid"] == "EPERM"  # uid 0 without CAP_SETUID
    assert lines["socket"] == "EPERM"
    if os.geteuid() == 0:
        assert lines["userns"] == os.readlink("/proc/self/ns/user")  # root needs no user namespace


def test_root_without_cap_sys_admin_goes_through_a_user_namespace(workdir, layers):
    """A container's root (no CAP_SYS_ADMIN) or any other user: namespaces inside a new user namespace."""
    if os.geteuid() != 0:
        pytest.skip("the child drops CAP_SYS_ADMIN, which only root has to drop")
    policy = {"layers": ["namespaces", "no_capabilities", "no_new_privs", "seccomp"]}
    need(layers, *policy["layers"])
    lines = said(child("status_without_sys_admin", workdir, layers, **policy), layers, **policy)
    assert lines["userns"] != os.readlink("/proc/self/ns/user")
    assert lines["uid_map"] == "0 0 1"  # only its own uid, mapped to itself
    assert lines["netns"] != os.readlink("/proc/self/ns/net")
    assert int(lines["CapEff:"], 16) == int(lines["CapBnd:"], 16) == 0
    assert lines["NoNewPrivs:"] == "1" and lines["Seccomp:"] == "2"
    assert lines["socket"] == "EPERM"


# ---------------------------------------------------------------- limits


def test_ten_gigabytes_is_a_memory_error(workdir, layers):
    need(layers, "rlimits")
    lines = said(child("memory", workdir, layers), layers)
    assert lines["big"] == "MemoryError"
    assert lines["small"] == str(64 * 2**20)


def test_memory_files_are_refused(workdir, layers):
    # Bytes written to a memfd count against no address-space limit: six of 256 MiB each were held past one of 256.
    need(layers, "seccomp")
    assert said(child("memfd", workdir, layers), layers)["memfd"] == "EPERM"


def test_system_v_ipc_objects_are_refused(workdir, layers):
    # A shared-memory segment filled and then detached counts against no address-space limit and lives as long as the
    # worker's IPC namespace: a served upload limited to 2 GiB held 2.5 GiB of them when its time ran out, nothing
    # bounded the total. Message queues and semaphore sets hold kernel memory the same way.
    need(layers, "seccomp")
    lines = said(child("sysv_ipc", workdir, layers), layers)
    assert (lines["shmget"], lines["msgget"], lines["semget"]) == ("EPERM", "EPERM", "EPERM")


def test_cpu_burner_dies_of_sigxcpu(workdir, layers):
    need(layers, "rlimits")
    done = child("cpu", workdir, layers, cpu_seconds=1)
    assert done.returncode == -signal.SIGXCPU, (done.returncode, done.stderr)
    assert said(done, layers)["burning"] == ""


def test_cpu_burner_ignoring_sigxcpu_dies_of_sigkill(workdir, layers):
    need(layers, "rlimits")
    done = child("cpu", workdir, layers, "ignore", cpu_seconds=1)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr)


def test_open_files_and_file_size_are_bounded(workdir, layers):
    need(layers, "rlimits", "private_workdir")
    lines = said(child("files", workdir, layers, open_files=32, file_bytes=2**20), layers)
    opened, error = lines["open_files"].split()
    assert error == "EMFILE" and int(opened) < 32
    assert lines["file_size"] == "EFBIG"
    assert lines["big"] == str(2**20)


def _core_pattern() -> str:
    try:
        return Path("/proc/sys/kernel/core_pattern").read_text().strip()
    except OSError:
        return "|unknown"


def _allow_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def test_segfault_leaves_no_core_dump(workdir, layers):
    need(layers, "no_core_dumps")
    settings = {"workdir": str(workdir), "memory_bytes": 2**30, "required": ["no_core_dumps"]}
    env = {"OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([PIE_SRC, os.environ.get("PYTHONPATH", "")])}

    def crash(policy: dict) -> subprocess.CompletedProcess:
        command = [sys.executable, str(CHILD), "segfault", json.dumps({**settings, **policy})]
        return subprocess.run(
            command, env=env, cwd=workdir, capture_output=True, text=True, timeout=TIMEOUT_S,
            preexec_fn=_allow_core_dumps,
        )  # fmt: skip

    pattern = _core_pattern()
    if not pattern.startswith("|") and "/" not in pattern:
        # The control: with cores allowed and the layer left off, the crash leaves one where we look.
        done = crash({"layers": ["private_workdir"], "required": ["private_workdir"]})
        assert done.returncode == -signal.SIGSEGV, done.stderr
        cores = list(workdir.iterdir())
        assert cores, f"no core file although allowed (core_pattern {pattern!r})"
        for core in cores:
            core.unlink()
    done = crash({})
    assert done.returncode == -signal.SIGSEGV, done.stderr
    assert done.stdout.splitlines()[-1] == "crashing"
    assert list(workdir.iterdir()) == []


def test_the_worker_cannot_make_itself_dumpable_again(workdir, layers):
    # prctl(PR_SET_DUMPABLE, 1) was allowed: an inferlet undid the layer, and processes of the same user could then
    # ptrace it and read its /proc files, and a core-dump handler behind a pipe was handed its memory when it crashed
    # (the kernel does not apply RLIMIT_CORE to a pipe).
    need(layers, "no_core_dumps", "seccomp")
    lines = said(child("dumpable", workdir, layers), layers)
    assert (lines["set"], lines["dumpable"]) == ("EPERM", "0")


# ---------------------------------------------------------------- healthy work goes on


@pytest.fixture
def shared_memory(tmp_path: Path):
    """Two 4 KiB files where POSIX shared memory lives: one the worker maps itself, one the host hands it."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    files = [base / f"pie-sandbox-test-{os.getpid()}-{name}" for name in ("mapped", "handed")]
    for path in files:
        path.write_bytes(bytes(4096))
    yield files
    for path in files:
        path.unlink(missing_ok=True)


def test_healthy_work_after_lock_down(workdir, layers, shared_memory):
    pipe_r, pipe_w = os.pipe()
    host, worker = socket.socketpair()
    shm_file, handed = shared_memory
    arg = json.dumps({"pipe": pipe_w, "sock": worker.fileno(), "shm": str(shm_file)})
    proc = child("healthy", workdir, layers, arg, popen=True, pass_fds=(pipe_w, worker.fileno()))
    try:
        # A run's own shared memory reaches a worker already locked down as a descriptor: Landlock checks
        # paths at open, a received descriptor is already open.
        with open(handed, "r+b") as handed_file:
            socket.send_fds(host, [b"ping"], [handed_file.fileno()])
        assert proc.stdout is not None and proc.stdin is not None
        lines = [proc.stdout.readline()]
        while lines[-1] and lines[-1].strip() != "ready":
            lines.append(proc.stdout.readline())
        assert lines[-1].strip() == "ready", (lines, proc.stderr.read() if proc.stderr else "")
        # Every thread, OpenBLAS's born after the lock-down included, is confined.
        tids = os.listdir(f"/proc/{proc.pid}/task")
        assert len(tids) >= 2, tids
        for tid in tids:
            status = Path(f"/proc/{proc.pid}/task/{tid}/status").read_text()
            if layers["seccomp"].available:
                assert "Seccomp:\t2" in status
            if layers["no_new_privs"].available:
                assert "NoNewPrivs:\t1" in status
            if layers["namespaces"].available:
                assert os.readlink(f"/proc/{proc.pid}/task/{tid}/ns/net") != os.readlink("/proc/self/ns/net")
        out, err = proc.communicate("\n", timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(pipe_w)
        worker.close()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines) + out, err)
    assert proc.returncode == 0, err
    said_lines = said(done, layers)
    assert said_lines["fft"] == "8.0"
    assert said_lines["matmul"] == "True"
    assert said_lines["blas_threads"] == "[2]"
    assert said_lines["asyncio"] == "42"
    assert said_lines["sock_recv"] == "ping 1"
    assert said_lines["memory"] == "anon! x"
    assert said_lines["healthy"] == "ok"
    assert os.read(pipe_r, 16) == b"pipe-ok"
    os.close(pipe_r)
    host.settimeout(5)
    assert host.recv(16) == b"sock-ok"
    host.close()
    assert shm_file.read_bytes()[:6] == b"shm-ok"
    assert handed.read_bytes()[:6] == b"passed"


# ---------------------------------------------------------------- refusals of lock_down itself


def test_threaded_process_is_refused(workdir, layers):
    done = child("threaded", workdir, layers)
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("SandboxError(None): lock_down needs a single-threaded process, this one runs 2")


def test_required_but_unavailable_layer_raises_before_anything_applies(workdir, layers):
    done = child("untouched", workdir, layers, min_landlock_abi=99, required=list(LAYERS))
    assert done.returncode == 3, done.stderr
    first, second = done.stdout.splitlines()
    assert first.startswith("SandboxError(landlock): sandbox layer landlock is required but unavailable: ")
    if layers["landlock"].available:
        assert re.search(r"Landlock ABI is \d+, the policy needs at least 99$", first), first
    assert second == "untouched True"  # nothing was applied: /etc/passwd is still readable


def test_layer_not_required_is_skipped(workdir, layers):
    required = [n for n in LAYERS if n != "landlock" and layers[n].available]
    done = child("read_passwd", workdir, layers, min_landlock_abi=99, required=required)
    out = done.stdout.splitlines()
    assert out[0].startswith(f"layers: {','.join(required)} "), done.stdout
    assert "read ALLOWED" in out


def test_workdir_must_be_empty(workdir, layers):
    (workdir / "left-over").write_text("x")
    done = child("fork", workdir, layers)
    assert done.returncode == 3
    assert done.stdout.strip() == f"SandboxError(private_workdir): workdir {workdir} is not empty"
