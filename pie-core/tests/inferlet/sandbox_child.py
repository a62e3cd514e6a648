"""A worker-like process for test_sandbox.py: imports, opens descriptors, locks itself down, runs one case.

Usage: ``python sandbox_child.py CASE POLICY_JSON [ARG]``. It prints ``layers: a,b,... (N ms)`` once locked
down, or ``SandboxError: ...`` and exits 3 when lock_down refuses; then whatever the case prints. Each case is
one thing an inferlet might try; a refused one prints the errno it got, so the test can tell a refusal by the
sandbox from any other failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import mmap
import os
import signal
import socket
import struct
import sys
import threading
import time

import numpy

from pie.inferlet.sandbox import SandboxError, SandboxPolicy, lock_down

try:  # as a worker does: pyseccomp's import runs ldconfig, which the sandbox then refuses
    import pyseccomp  # noqa: F401
except (ImportError, RuntimeError):
    pass  # lock_down reports the seccomp layer unavailable

SECRET = b"sk-pie-test-secret"
# Who gets a descriptor's SIGIO, and which signal it is (asm-generic/fcntl.h and sockios.h: x86_64 and arm64 alike).
F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETLEASE = 8, 10, 15, 1024
F_OWNER_PID = 1
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902


def refused(what: str, action) -> None:
    """Run ``action``; print ``what errno-name`` if it raised OSError, ``what ALLOWED`` if it did not."""
    try:
        action()
    except OSError as exc:
        print(what, errno.errorcode.get(exc.errno or 0, exc.errno), flush=True)
    else:
        print(what, "ALLOWED", flush=True)


def env_block() -> tuple[int, int]:
    with open("/proc/self/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return int(fields[47]), int(fields[48])


# ---------------------------------------------------------------- what a case sets up before the lock-down


def before_healthy(arg: str) -> dict:
    spec = json.loads(arg)
    anonymous = mmap.mmap(-1, 4096)
    fd = os.open(spec["shm"], os.O_RDWR)
    shared = mmap.mmap(fd, 4096)
    os.close(fd)  # the mapping outlives the descriptor, as a worker's logits buffer does
    lazy = ["numpy.fft", "sqlite3", "xml.etree.ElementTree", "decimal"]
    assert not any(name in sys.modules for name in lazy), [name for name in lazy if name in sys.modules]
    from threadpoolctl import ThreadpoolController

    blas = ThreadpoolController()  # it reads /proc/self/maps to find the BLAS libraries: before the lock-down
    return {"anonymous": anonymous, "shared": shared, "pipe": spec["pipe"], "sock": spec["sock"], "lazy": lazy,
            "blas": blas}  # fmt: skip


def before_threaded(arg: str) -> None:
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()


def before_no_sys_admin(arg: str) -> None:
    """Be root without CAP_SYS_ADMIN, as in a default container: lock_down must go through a user namespace."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(header), data) == 0
    cap_sys_admin = 1 << 21
    data[0].effective &= ~cap_sys_admin
    data[0].permitted &= ~cap_sys_admin
    assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()


def libc_call(name: str, *args: object) -> int:
    """The libc function ``name``; OSError with its errno where it returns -1."""
    result = getattr(ctypes.CDLL(None, use_errno=True), name)(*args)
    if result == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


BEFORE = {
    "healthy": before_healthy,
    "status_without_sys_admin": before_no_sys_admin,
    "fill_without_sys_admin": before_no_sys_admin,
    "threaded": before_threaded,
    "environ": lambda arg: env_block(),
    "inotify": lambda arg: libc_call("inotify_init1", 0),  # one opened before the lock-down, as a worker could
}


# ---------------------------------------------------------------- cases, run after the lock-down


def case_system(arg, state):
    print("system", os.system("echo hi"), flush=True)


def case_subprocess(arg, state):
    import subprocess

    refused("subprocess", lambda: subprocess.run(["true"]))


def case_execv(arg, state):
    refused("execv", lambda: os.execv("/bin/true", ["true"]))


def fork_once() -> None:
    if os.fork() == 0:
        os._exit(0)


def case_fork(arg, state):
    refused("fork", fork_once)


def case_fork_bomb(arg, state):
    forked = 0
    try:
        while forked < 200:  # bounded, should the sandbox ever let one through
            if os.fork() == 0:
                os._exit(0)
            forked += 1
    except OSError as exc:
        print("fork_bomb", forked, errno.errorcode[exc.errno or 0], flush=True)
    done = threading.Event()
    threading.Thread(target=done.set).start()  # threads still start
    print("thread", done.wait(10), flush=True)


def case_read_passwd(arg, state):
    refused("read", lambda: open("/etc/passwd").read())
    refused("list", lambda: os.listdir("/etc"))
    refused("proc", lambda: open("/proc/self/status").read())


def case_write(arg, state):
    refused("outside", lambda: open(arg, "w").write("escaped"))
    refused("mkdir_outside", lambda: os.mkdir(arg + ".dir"))
    with open("inside.txt", "w") as out:
        out.write("inside")
    os.mkdir("sub")
    os.rename("inside.txt", "sub/inside.txt")
    print("inside", open("sub/inside.txt").read(), os.path.realpath("sub/inside.txt"), flush=True)
    print("cwd", os.getcwd(), flush=True)


def case_fill(arg, state):
    """Write 64 KiB pieces into one file, then empty files, until the folder refuses; print how far each got."""
    written = 0
    try:
        with open("big", "wb", buffering=0) as big:
            for _ in range(1024):
                written += big.write(b"x" * 65536)
    except OSError as exc:
        print("bytes", errno.errorcode.get(exc.errno or 0, exc.errno), written, flush=True)
    os.remove("big")
    made = 0
    try:
        for i in range(10_000):
            open(f"f{i}", "w").close()
            made += 1
    except OSError as exc:
        print("files", errno.errorcode.get(exc.errno or 0, exc.errno), made, flush=True)
    print("cwd", os.getcwd(), flush=True)


case_fill_without_sys_admin = case_fill


def case_chmod(arg, state):
    refused("chmod", lambda: os.chmod(arg, 0o777))
    refused("utime", lambda: os.utime(arg, (0, 0)))


def case_connect(arg, state):
    import socket

    refused("connect", lambda: socket.create_connection(("127.0.0.1", int(arg)), timeout=5))


def case_environ(arg, state):
    import posix

    start, end = state
    print(
        "environ",
        json.dumps(
            {
                "os.environ": dict(os.environ),
                "getenv": os.getenv("PIE_API_KEY"),
                "posix.environ": SECRET.decode() in str(posix.environ),
                "block": SECRET in ctypes.string_at(start, end - start),
            }
        ),
        flush=True,
    )
    refused("proc_environ", lambda: open("/proc/self/environ", "rb").read())


def case_memory(arg, state):
    try:
        bytearray(10 * 2**30)
    except MemoryError:
        print("big MemoryError", flush=True)
    else:
        print("big ALLOWED", flush=True)
    print("small", len(bytearray(64 * 2**20)), flush=True)


def case_memfd(arg, state):
    refused("memfd", lambda: os.close(os.memfd_create("hoard")))


def case_sysv_ipc(arg, state):
    """Each System V IPC object a worker could make: its bytes stay in the IPC namespace once detached or sent."""
    refused("shmget", lambda: libc_call("shmget", 0, 2**20, 0o1000 | 0o600))  # IPC_PRIVATE, IPC_CREAT
    refused("msgget", lambda: libc_call("msgget", 0, 0o1000 | 0o600))
    refused("semget", lambda: libc_call("semget", 0, 1, 0o1000 | 0o600))


def case_dumpable(arg, state):
    """Undo the no_core_dumps layer's PR_SET_DUMPABLE 0 (4 is PR_SET_DUMPABLE, 3 PR_GET_DUMPABLE)."""
    refused("set", lambda: libc_call("prctl", 4, 1, 0, 0, 0))
    print("dumpable", libc_call("prctl", 3, 0, 0, 0, 0), flush=True)


def case_cpu(arg, state):
    if arg == "ignore":
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
    print("burning", flush=True)
    while True:
        pass


def case_segfault(arg, state):
    print("crashing", flush=True)
    ctypes.string_at(0)


def case_kill(arg, state):
    refused("kill", lambda: os.kill(os.getppid(), 0))
    os.kill(os.getpid(), 0)  # itself stays allowed
    print("self ok", flush=True)


def fcntl_syscall(fd: int, command: int, value: int) -> None:
    """fcntl by its syscall, which lets the command carry bits above the 32 the kernel reads."""
    import pyseccomp

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    number = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "fcntl")
    if libc.syscall(ctypes.c_long(number), ctypes.c_long(fd), ctypes.c_long(command), ctypes.c_long(value)) == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def case_sigio(arg, state):
    """Each way of making another process a socket's owner, then SIGKILL as its SIGIO and data to read: the owner
    dies where one works and nothing scopes signals (Landlock before ABI 6)."""
    victim = int(arg)
    owners = {
        "F_SETOWN": lambda fd: fcntl.fcntl(fd, F_SETOWN, victim),
        "F_SETOWN_EX": lambda fd: fcntl.fcntl(fd, F_SETOWN_EX, struct.pack("ii", F_OWNER_PID, victim)),
        "FIOSETOWN": lambda fd: fcntl.ioctl(fd, FIOSETOWN, struct.pack("i", victim)),
        "SIOCSPGRP": lambda fd: fcntl.ioctl(fd, SIOCSPGRP, struct.pack("i", victim)),
        "F_SETOWN_high_bits": lambda fd: fcntl_syscall(fd, 1 << 32 | F_SETOWN, victim),
    }
    for name, set_owner in owners.items():
        a, b = socket.socketpair()
        with a, b:
            refused(name, functools.partial(set_owner, a.fileno()))
            with contextlib.suppress(OSError):
                fcntl.fcntl(a, F_SETSIG, signal.SIGKILL)
            fcntl.fcntl(a, fcntl.F_SETFL, fcntl.fcntl(a, fcntl.F_GETFL) | os.O_ASYNC)
            b.send(b"x")
    a, b = socket.socketpair()
    refused("F_SETSIG", lambda: fcntl.fcntl(a, F_SETSIG, signal.SIGKILL))
    with open("leased", "w"):
        pass
    with open("leased") as leased:  # a lease makes whoever else opens the file wait for its holder
        refused("F_SETLEASE", lambda: fcntl.fcntl(leased, F_SETLEASE, fcntl.F_RDLCK))


def case_inotify(arg, state):
    """Watch a folder outside the sandbox (Landlock does not mediate inotify): names and accesses of other files."""
    in_create, in_access = 0x100, 0x1
    refused("inotify_init", lambda: libc_call("inotify_init"))
    refused("inotify_init1", lambda: libc_call("inotify_init1", 0))
    refused("inotify_add_watch", lambda: libc_call("inotify_add_watch", state, arg.encode(), in_create | in_access))
    refused("fanotify_init", lambda: libc_call("fanotify_init", 0, 0))


def case_files(arg, state):
    opened = []
    try:
        for i in range(200):
            opened.append(open(f"f{i}", "w"))
    except OSError as exc:
        print("open_files", len(opened), errno.errorcode[exc.errno or 0], flush=True)
    for f in opened:
        f.close()
    refused("file_size", lambda: open("big", "wb").write(b"x" * (2 * 2**20)))
    print("big", os.stat("big").st_size, flush=True)


def case_status(arg, state):
    """For a child that leaves Landlock off: the kernel's own account of its confinement."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("Cap", "NoNewPrivs", "Seccomp:")):
                print(" ".join(line.split()), flush=True)
    print("netns", os.readlink("/proc/self/ns/net"), flush=True)
    print("ipcns", os.readlink("/proc/self/ns/ipc"), flush=True)
    print("userns", os.readlink("/proc/self/ns/user"), flush=True)
    with open("/proc/self/uid_map") as uid_map:
        print("uid_map", " ".join(uid_map.read().split()), flush=True)
    refused("setuid", lambda: os.setuid(12345))
    refused("socket", lambda: __import__("socket").socket())


case_status_without_sys_admin = case_status


def case_healthy(arg, state):
    import asyncio
    import importlib
    import socket
    import tempfile

    for name in state["lazy"]:
        importlib.import_module(name)
    rng = numpy.random.default_rng(0)
    print("fft", round(float(numpy.abs(numpy.fft.fft(numpy.ones(8)))[0]), 3), flush=True)
    state["blas"].limit(limits=2, user_api="blas")  # OpenBLAS's thread pool is born inside the sandbox
    a = rng.standard_normal((300, 300))
    print("matmul", bool(numpy.allclose(a @ a, numpy.einsum("ij,jk->ik", a, a))), flush=True)
    blas_threads = [info["num_threads"] for info in state["blas"].info() if info["user_api"] == "blas"]
    print("blas_threads", blas_threads, flush=True)

    async def answer():
        await asyncio.sleep(0)
        return 42

    print("asyncio", asyncio.run(answer()), flush=True)
    os.write(state["pipe"], b"pipe-ok")
    sock = socket.socket(fileno=state["sock"])
    data, fds, _, _ = socket.recv_fds(sock, 16, 1)  # a descriptor the host hands over after the lock-down
    print("sock_recv", data.decode(), len(fds), flush=True)
    passed = mmap.mmap(fds[0], 4096)
    passed[:6] = b"passed"
    passed.flush()
    sock.sendmsg([b"sock-ok"])
    state["anonymous"][:5] = b"anon!"
    state["shared"][:6] = b"shm-ok"
    state["shared"].flush()
    fresh = mmap.mmap(-1, 2**20)
    fresh[-1:] = b"x"
    with tempfile.TemporaryFile() as scratch:
        scratch.write(b"scratch")
    print("memory", bytes(state["anonymous"][:5]).decode(), fresh[-1:].decode(), flush=True)
    print("ready", flush=True)
    sys.stdin.readline()  # the test looks at this process's threads meanwhile
    print("healthy ok", flush=True)


def case_fds(arg, state):
    spec = json.loads(arg)
    refused("kept", lambda: os.write(spec["keep"], b"kept"))
    refused("dropped", lambda: os.write(spec["drop"], b"dropped"))


def case_threaded(arg, state):
    print("locked down although threaded", flush=True)


def case_untouched(arg, state):
    print("untouched", len(open("/etc/passwd").read()) > 0, flush=True)


def main() -> None:
    name, settings = sys.argv[1], json.loads(sys.argv[2])
    arg = sys.argv[3] if len(sys.argv) > 3 else ""
    for key in ("read_only_paths", "writable_paths"):
        if key in settings:
            settings[key] = tuple(settings[key])
    for key in ("layers", "required", "keep_fds"):
        if key in settings:
            settings[key] = frozenset(settings[key])
    state = BEFORE[name](arg) if name in BEFORE else None
    started = time.perf_counter()
    try:
        layers = lock_down(SandboxPolicy(**settings))
    except SandboxError as exc:
        print(f"SandboxError({exc.layer}): {exc}", flush=True)
        if name == "untouched":
            case_untouched(arg, state)
        sys.exit(3)
    print(f"layers: {','.join(layers)} ({(time.perf_counter() - started) * 1e3:.2f} ms)", flush=True)
    globals()[f"case_{name}"](arg, state)


if __name__ == "__main__":
    main()
