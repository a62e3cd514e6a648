"""The sandbox a served inferlet's worker process puts itself in before it runs any inferlet code.

A worker process calls :func:`lock_down` on itself once, after its imports and after it has opened what it
needs from the host (its pipe or socket, its shared-memory mapping), and before the inferlet runs. Each
*layer* is one kernel mechanism, applied in this order, because each later one takes away something an
earlier one needs:

==================== =====================================================================================
``namespaces``       fresh network, IPC and mount namespaces: no interface but a loopback device that is down,
                     no System V IPC or message queue of the host, and mounts of its own that the host never
                     sees. As root ``unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWNS)``; otherwise inside a
                     new user namespace that maps only the worker's own uid and gid (what the kernel lets an
                     unprivileged process do).
``rlimits``          address space, CPU seconds (counted from the lock-down: SIGXCPU at the limit, SIGKILL a
                     second later), open files, size of a written file, and tasks where the kernel counts
                     only the worker's own (in its own user namespace; it never counts them for root).
``no_core_dumps``    RLIMIT_CORE 0 and the process made non-dumpable (which also keeps processes of the same
                     user from ptrace-ing it or reading its /proc files).
``empty_environment``  ``os.environ``, ``posix.environ`` and the C environment emptied, and the environment
                     block the kernel handed the process at exec (what /proc/PID/environ shows) zeroed;
                     then only the policy's ``environment`` is set.
``private_workdir``  the current directory becomes the policy's private, empty directory. In a mount namespace
                     of its own, a tmpfs of ``folder_bytes`` and ``folder_files`` is mounted over it first:
                     what the worker writes is bounded in total (ENOSPC past it), not only per file, and goes
                     when the worker does. That memory is not in the address-space limit: a worker may hold
                     ``memory_bytes`` plus ``folder_bytes``.
``no_capabilities``  every capability dropped (effective, permitted, inheritable, ambient, bounding set) and
                     the securebits locked so that none comes back: a worker of a server run as root keeps
                     uid 0 but loses root's powers.
``no_new_privs``     ``PR_SET_NO_NEW_PRIVS``: no set-uid bit or file capability can ever raise privileges.
``landlock``         filesystem: read (never execute) the Python installation (:func:`python_paths`), read and
                     write the private directory, nothing else; with Landlock ABI 4 no TCP bind or connect;
                     with ABI 6 no signal to and no abstract UNIX socket of a process outside the sandbox.
``seccomp``          last, a syscall filter (a deny list over an allowed default, since an allow list would
                     break on whatever syscall the next glibc or numpy starts to use): no ``execve``, no new
                     process (``clone`` only with ``CLONE_THREAD``; ``clone3`` answers ENOSYS so that libc falls
                     back to ``clone``, whose flags a filter can read), no socket (only ``socketpair`` of
                     AF_UNIX, which asyncio's event loop needs), no ptrace or access to other processes'
                     memory, no mount, namespace, keyring, BPF, io_uring, module or clock syscalls, no change of
                     file modes, owners, times or extended attributes and no inotify or fanotify watch (Landlock
                     does not cover those), no signal to any process but itself, nor a signal owner for a descriptor
                     (``F_SETOWN``, ``F_SETOWN_EX``, ``FIOSETOWN``, ``SIOCSPGRP``: its SIGIO would reach any process
                     of the same uid, any process at all as root, where Landlock before ABI 6 scopes no signal), nor
                     a choice of that signal (``F_SETSIG``) or a file lease (``F_SETLEASE``), no way back to being
                     dumpable (``PR_SET_DUMPABLE``), no raising of rlimits
                     and no memory file (``memfd``) or System V IPC object (``shmget``, ``msgget``, ``semget``):
                     memory the address-space limit does not count; syscalls numbered
                     past the newest this module knows answer ENOSYS.
==================== =====================================================================================

Descriptors opened before the lock-down keep working: Landlock checks a path when it is opened, seccomp
refuses only creating sockets and processes, never reading, writing, ``sendmsg``/``recvmsg``, ``mmap`` or
``futex``. Threads are allowed, processes are not.

What a worker must do before calling :func:`lock_down`:

- be **single-threaded**. Namespaces, capabilities, no_new_privs and Landlock belong to the calling thread and
  the threads it starts later; a thread that already runs would keep the host's view. numpy's OpenBLAS starts
  its thread pool when numpy is imported, so start the worker with ``OPENBLAS_NUM_THREADS=1`` (and
  ``OMP_NUM_THREADS=1``) and raise the count after the lock-down: the pool's new threads are then born inside
  the sandbox. threadpoolctl finds the BLAS libraries by reading /proc/self/maps, which Landlock then refuses:
  make its ``ThreadpoolController()`` before and call ``controller.limit(limits=n, user_api="blas")`` after.
  :func:`lock_down` refuses a threaded process.
- import what it needs that lives outside :func:`python_paths` and open its descriptors: the pipe or socket to
  the host, the shared-memory segment (open ``/dev/shm/NAME`` and ``mmap`` it; ``multiprocessing``'s
  ``SharedMemory`` would start a resource-tracker process outside the sandbox), the inferlet's source.
- import ``pyseccomp`` early: its import looks for libseccomp by running ``ldconfig`` (refused afterwards), the
  slowest step of all; :func:`lock_down` imports it itself, before any layer, where the worker has not.
- be *started* with an almost empty environment (the fork server's ``Popen(env=...)``, :mod:`pie.inferlet.zygote`,
  which every worker is forked from). Emptying it here is a
  backstop: copies of a variable made by Python code before the lock-down can live on in freed memory that
  ``ctypes`` can read.

A :class:`SandboxError` from :func:`lock_down` may leave the process partly confined: the worker must exit.

Why these bindings: **pyseccomp** (PyPI) binds the system's libseccomp through ctypes and keeps the API of
libseccomp's own Python bindings (Debian's ``python3-seccomp``, which a virtual environment cannot use);
libseccomp is what resolves syscall names per architecture and refuses x32 and foreign-architecture
syscalls, the error-prone part of writing BPF by hand. It needs libseccomp's shared library (Debian:
``libseccomp2``). **Landlock** is three syscalls and three structs, written here with ctypes: PyPI's most
used binding (``landlock``) is an alpha development release that knows only ABI 1-5 (no TCP rules, no
scoping) and judges a call by a stale errno rather than its result; the younger bindings are
single-maintainer packages used by few, and a security boundary is easier to audit in a hundred lines here
than as a dependency. **unshare** is also ctypes: ``os.unshare`` exists only from Python 3.12.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

LAYERS: tuple[str, ...] = (
    "namespaces",
    "rlimits",
    "no_core_dumps",
    "empty_environment",
    "private_workdir",
    "no_capabilities",
    "no_new_privs",
    "landlock",
    "seccomp",
)
"""Every layer :func:`lock_down` knows, in the order it applies them."""

_LINUX = sys.platform.startswith("linux")


class SandboxError(Exception):
    """A layer the policy requires cannot be applied, or the process is not fit to be locked down."""

    def __init__(self, message: str, layer: str | None = None):
        super().__init__(message)
        self.layer = layer


@dataclass(frozen=True)
class LayerStatus:
    """Whether one layer can be (or was) applied on this machine, and what it did or why it could not."""

    name: str
    available: bool
    detail: str


@dataclass(frozen=True)
class SandboxPolicy:
    """What a worker locks itself down to. Every limit applies to the whole worker process."""

    workdir: str
    """The private working directory: absolute, existing, empty; the only place the worker may write."""
    memory_bytes: int = 2 * 2**30
    """RLIMIT_AS: the address space the worker may map (a larger allocation raises MemoryError)."""
    cpu_seconds: int = 60
    """CPU time the worker may use after the lock-down: SIGXCPU then, SIGKILL one second later."""
    open_files: int = 64
    """RLIMIT_NOFILE: no new descriptor numbered at or above this (descriptors already open stay usable)."""
    file_bytes: int = 256 * 2**20
    """RLIMIT_FSIZE: the largest file the worker may write (a larger write fails with EFBIG)."""
    folder_bytes: int = 256 * 2**20
    """What all the files in ``workdir`` may hold together, where the worker has a mount namespace of its own (a
    larger write fails with ENOSPC)."""
    folder_files: int = 4096
    """Files and directories ``workdir`` may hold, likewise (a tmpfs's inodes are memory too)."""
    max_threads: int = 64
    """RLIMIT_NPROC beyond the worker's own task, where the kernel counts only the worker's tasks (its own user
    namespace); the kernel never applies it to root. New processes are refused by seccomp in any case."""
    read_only_paths: tuple[str, ...] | None = None
    """Files and directories the worker may read; None: :func:`python_paths` as the worker sees them."""
    writable_paths: tuple[str, ...] = ()
    """Directories (or files) the worker may also write, beside ``workdir``."""
    network: bool = False
    """True keeps the host's network: no network namespace, no refusal of sockets or TCP."""
    environment: Mapping[str, str] = field(default_factory=dict, hash=False)
    """The environment the worker gets after its own is emptied."""
    keep_fds: frozenset[int] | None = None
    """When given, every other descriptor above 2 is closed before the layers are applied."""
    min_landlock_abi: int = 1
    """The oldest Landlock ABI accepted (4: TCP rules; 6: signal and abstract-socket scoping)."""
    layers: frozenset[str] = frozenset(LAYERS)
    """The layers to apply; the others are left off (a trusted worker, or a test of one layer alone)."""
    required: frozenset[str] | None = None
    """Layers that must apply (None: all of ``layers``): one that cannot raises :class:`SandboxError`; one
    not required that cannot apply is skipped, and :func:`lock_down` does not list it."""

    def __post_init__(self) -> None:
        if not os.path.isabs(self.workdir):
            raise ValueError(f"workdir must be an absolute path, got {self.workdir!r}")
        for name in ("memory_bytes", "cpu_seconds", "open_files", "file_bytes", "folder_bytes", "folder_files"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_threads < 0:
            raise ValueError(f"max_threads must not be negative, got {self.max_threads}")
        if self.required is None:
            object.__setattr__(self, "required", frozenset(self.layers))
        unknown = (set(self.layers) | set(self.required)) - set(LAYERS)
        if unknown:
            raise ValueError(f"unknown sandbox layers {sorted(unknown)}; known: {', '.join(LAYERS)}")
        if not set(self.required) <= set(self.layers):
            raise ValueError(f"layers {sorted(set(self.required) - set(self.layers))} are required but left off")
        for path in (*(self.read_only_paths or ()), *self.writable_paths):
            if os.path.realpath(path) == "/":
                raise ValueError("'/' would give the worker the whole filesystem")


# ---------------------------------------------------------------- paths the worker may read

_SYSTEM_LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")
"""Where the dynamic loader finds the libraries a lazily imported extension links (liblzma, libffi, ...)."""
_SYSTEM_READ_PATHS = ("/etc/ld.so.cache", "/sys/devices/system/cpu")
"""The loader's index of those libraries, and the CPU topology that sysconf and BLAS libraries read."""
_DEVICES_READ = ("/dev/urandom", "/dev/random", "/dev/zero")
_DEVICES_WRITE = ("/dev/null",)


def python_paths() -> tuple[str, ...]:
    """What a worker needs to read to import lazily after the lock-down, as this process sees it.

    The installation's prefixes and standard library, every ``sys.path`` entry (site-packages, editable
    source trees), the folder of every module already imported from elsewhere, and the system library
    folders its extensions link against. Never the current directory (``''`` on ``sys.path``: the
    server's own folder), never ``/``; resolved, existing, and without a path inside another.
    """
    try:
        cwd: str | None = os.path.realpath(os.getcwd())
    except OSError:
        cwd = None
    roots = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(os.__file__)]
    roots += [entry for entry in sys.path if entry]
    known = tuple(os.path.join(os.path.realpath(root), "") for root in roots) + tuple(
        os.path.join(root, "") for root in roots
    )
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None)
        if isinstance(filename, str) and os.path.isabs(filename) and not filename.startswith(known):
            roots.append(os.path.dirname(filename))
    roots += [*_SYSTEM_LIBRARY_DIRS, *_SYSTEM_READ_PATHS]
    found = set()
    for root in roots:
        real = os.path.realpath(root)
        if real not in ("/", cwd) and os.path.exists(real):
            found.add(real)
    return _outermost(found)


def _outermost(paths: Iterable[str]) -> tuple[str, ...]:
    """The paths without those that lie inside another of them, sorted."""
    kept: list[str] = []
    for path in sorted(paths):
        if not kept or not path.startswith(os.path.join(kept[-1], "")):
            kept.append(path)
    return tuple(kept)


# ---------------------------------------------------------------- libc through ctypes


class _Unavailable(Exception):
    """This layer cannot be applied here; the message says why."""


_libc_handle: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _libc_handle
    if _libc_handle is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        libc.prctl.restype = ctypes.c_int
        libc.unshare.argtypes = [ctypes.c_int]
        libc.unshare.restype = ctypes.c_int
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        libc.mount.restype = ctypes.c_int
        _libc_handle = libc
    return _libc_handle


def _check(result: int, what: str) -> int:
    """``result`` of a libc call, or the OSError its errno describes when it is -1."""
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _prctl(option: int, arg2: int = 0, what: str = "prctl") -> int:
    return _check(_libc().prctl(option, arg2, 0, 0, 0), what)


def _syscall(number: int, *args: object, what: str) -> int:
    """``syscall(number, *args)``: integers pass as C longs, ``ctypes.byref`` results as pointers."""
    converted = [ctypes.c_long(arg) if isinstance(arg, int) else arg for arg in args]
    return _check(_libc().syscall(ctypes.c_long(number), *converted), what)


_PR_SET_DUMPABLE = 4
_PR_CAPBSET_READ = 23
_PR_CAPBSET_DROP = 24
_PR_SET_SECUREBITS = 28
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_SETPCAP = 8
# SECBIT_NOROOT, its lock, SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE and its lock.
_SECUREBITS = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7)

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWCGROUP = 0x02000000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_CLONE_THREAD = 0x00010000
_NAMESPACE_FLAGS = (
    _CLONE_NEWNS,
    _CLONE_NEWCGROUP,
    _CLONE_NEWUTS,
    _CLONE_NEWIPC,
    _CLONE_NEWUSER,
    _CLONE_NEWPID,
    _CLONE_NEWNET,
)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


# ---------------------------------------------------------------- Landlock (linux/landlock.h)

# One number on every architecture with the unified syscall table (all but alpha and MIPS, which answer ENOSYS).
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
_LANDLOCK_RULE_PATH_BENEATH = 1

_FS_EXECUTE = 1 << 0
_FS_WRITE_FILE = 1 << 1
_FS_READ_FILE = 1 << 2
_FS_READ_DIR = 1 << 3
_FS_MAKE_CHAR = 1 << 6
_FS_MAKE_SOCK = 1 << 9
_FS_MAKE_FIFO = 1 << 10
_FS_MAKE_BLOCK = 1 << 11
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_FS_IOCTL_DEV = 1 << 15  # ABI 5
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
"""The rights that mean something on a file that is not a directory (a rule on a file may hold no others)."""
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1  # ABI 6


class _RulesetAttr(ctypes.Structure):
    # The kernel takes the larger struct of a newer ABI when the fields it does not know are zero.
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version, or :class:`_Unavailable` saying why there is none."""
    try:
        return _syscall(
            _SYS_LANDLOCK_CREATE_RULESET, 0, 0, _LANDLOCK_CREATE_RULESET_VERSION, what="landlock_create_ruleset"
        )
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            raise _Unavailable("the kernel has no Landlock (needs Linux 5.13 with CONFIG_SECURITY_LANDLOCK)") from exc
        if exc.errno == errno.EOPNOTSUPP:
            raise _Unavailable("Landlock is built in but not enabled (add landlock to the lsm= boot parameter)") from exc
        raise _Unavailable(f"Landlock version query failed: {exc}") from exc


class _Ruleset:
    """A Landlock ruleset being built: what it handles (refuses unless a rule allows), then rules, then applied."""

    def __init__(self, abi: int, network: bool):
        fs = (1 << 13) - 1
        fs |= _FS_REFER if abi >= 2 else 0
        fs |= _FS_TRUNCATE if abi >= 3 else 0
        fs |= _FS_IOCTL_DEV if abi >= 5 else 0
        net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 and not network else 0
        scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
        self.abi, self.handled_fs, self.handled_net, self.scoped = abi, fs, net, scoped
        attr = _RulesetAttr(fs, net, scoped)
        self.fd = _syscall(
            _SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0, what="landlock_create_ruleset"
        )
        self.read = self.written = 0

    def allow(self, path: str, rights: int) -> None:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            if not os.path.isdir(path):
                rights &= _FS_FILE_RIGHTS
            rule = _PathBeneathAttr(rights & self.handled_fs, fd)
            _syscall(
                _SYS_LANDLOCK_ADD_RULE,
                self.fd,
                _LANDLOCK_RULE_PATH_BENEATH,
                ctypes.byref(rule),
                0,
                what=f"landlock_add_rule({path})",
            )
        finally:
            os.close(fd)

    def allow_read(self, path: str) -> None:
        self.allow(path, _FS_READ_FILE | _FS_READ_DIR)
        self.read += 1

    def allow_write(self, path: str) -> None:
        never = _FS_EXECUTE | _FS_MAKE_CHAR | _FS_MAKE_BLOCK | _FS_MAKE_SOCK | _FS_MAKE_FIFO | _FS_IOCTL_DEV
        self.allow(path, self.handled_fs & ~never)
        self.written += 1

    def restrict_self(self) -> None:
        try:
            _syscall(_SYS_LANDLOCK_RESTRICT_SELF, self.fd, 0, what="landlock_restrict_self")
        finally:
            os.close(self.fd)

    def describe(self) -> str:
        text = f"ABI {self.abi}: read {self.read} paths, write {self.written}, execute none"
        if self.handled_net:
            text += "; TCP bind and connect refused"
        if self.scoped:
            text += "; signals and abstract UNIX sockets scoped to the sandbox"
        return text


# ---------------------------------------------------------------- seccomp (through pyseccomp)

_REFUSED = (
    # new programs, new processes
    "execve", "execveat", "fork", "vfork",
    # other processes: tracing, their memory, their descriptors, signals by pidfd
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "process_mrelease", "kcmp",
    "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "tkill",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "open_tree_attr", "fsopen", "fsconfig", "fsmount", "fspick", "listmount", "statmount",
    # file metadata, which Landlock does not cover: modes, owners, times, extended attributes, inode flags
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime", "utimes",
    "utimensat", "futimesat", "setxattr", "lsetxattr", "fsetxattr", "setxattrat", "removexattr", "lremovexattr",
    "fremovexattr", "removexattrat", "file_setattr", "name_to_handle_at", "open_by_handle_at",
    # the kernel and the machine
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "iopl", "ioperm", "modify_ldt", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "add_key", "request_key",
    "keyctl", "uselib", "_sysctl", "sysfs", "ustat", "lookup_dcookie",
    # watching files, which Landlock does not cover: names made, opened and read in folders it may not list
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init",
    # limits, and memory they do not count (a memfd's bytes are no part of the address space, nor a System V
    # segment's once detached, nor what a message queue or semaphore set holds: all live on in the IPC namespace)
    "setrlimit", "memfd_create", "memfd_secret", "shmget", "msgget", "semget", "ipc",
)  # fmt: skip
_REFUSED_NETWORK = ("socket", "connect", "bind", "listen", "accept", "accept4")
_UNIFIED_NUMBERS = {
    "process_mrelease": 448, "mount_setattr": 442, "open_tree_attr": 467, "listmount": 458, "statmount": 457,
    "memfd_secret": 447, "fchmodat2": 452, "setxattrat": 463, "removexattrat": 466, "file_setattr": 469, "quotactl_fd": 443,
}  # fmt: skip
"""Numbers of syscalls newer than some libseccomp releases, the same on every unified-table architecture."""
_NEWEST_KNOWN_SYSCALL = 469
"""Syscalls numbered above this (not yet in any kernel this module knows) answer ENOSYS, so that a deny
list written today does not silently allow what a later kernel adds; libc falls back on ENOSYS."""
_UNIFIED_TABLE = ("x86_64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x")
_AF_UNIX = 1
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
# Who receives a descriptor's SIGIO (the kernel checks it only against the uid that set the owner: root's reaches
# every process) and which signal that is: F_SETOWN, F_SETSIG, F_SETOWN_EX, FIOSETOWN and SIOCSPGRP (asm-generic's
# numbers, which every architecture of _UNIFIED_TABLE uses). A lease (F_SETLEASE) makes whoever else opens the file
# wait for the worker.
_SIGNAL_OWNER_FCNTLS = (8, 10, 15, 1024)
_SIGNAL_OWNER_IOCTLS = (0x8901, 0x8902)


def _seccomp_filter(policy: SandboxPolicy, pid: int) -> tuple[object, str]:
    """The filter to load last, not loaded yet, and a description; :class:`_Unavailable` without libseccomp."""
    try:
        import pyseccomp as sc
    except ImportError as exc:
        raise _Unavailable("pyseccomp is not installed (pip install pyseccomp)") from exc
    except RuntimeError as exc:  # pyseccomp raises this when it cannot find libseccomp.so.2
        raise _Unavailable(f"libseccomp is missing (Debian: apt-get install libseccomp2): {exc}") from exc
    unified = os.uname().machine in _UNIFIED_TABLE
    refuse = sc.ERRNO(errno.EPERM)
    refused: list[str] = []
    unknown: list[str] = []

    def rule(action: int, name: str, *args: object) -> None:
        try:
            filt.add_rule(action, name, *args)
        except OSError:
            if name in _UNIFIED_NUMBERS and unified:
                filt.add_rule(action, _UNIFIED_NUMBERS[name], *args)
            else:
                unknown.append(name)
                return
        refused.append(name)

    try:
        filt = sc.SyscallFilter(sc.ALLOW)
        filt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)  # x32 and foreign-architecture syscalls
        filt.set_attr(sc.Attr.CTL_TSYNC, 1)
        for name in _REFUSED:
            rule(refuse, name)
        if not policy.network:
            for name in _REFUSED_NETWORK:
                rule(refuse, name)
            rule(refuse, "socketpair", sc.Arg(0, sc.NE, _AF_UNIX))
        # Threads only: a clone without CLONE_THREAD is a new process; none may enter a new namespace.
        rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
        for flag in _NAMESPACE_FLAGS:
            rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags sit behind a pointer no filter can read
        # Signals, priorities, placement and limits: only of itself (pid 0 means itself).
        for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
            rule(refuse, name, sc.Arg(0, sc.NE, pid))
        for name in ("sched_setaffinity", "sched_setparam", "sched_setscheduler", "sched_setattr", "migrate_pages",
                     "move_pages", "prlimit64"):  # fmt: skip
            rule(refuse, name, sc.Arg(0, sc.NE, 0))
        rule(refuse, "prlimit64", sc.Arg(2, sc.NE, 0))  # a new limit; reading its own stays allowed
        rule(refuse, "setpriority", sc.Arg(0, sc.NE, 0))
        rule(refuse, "setpriority", sc.Arg(1, sc.NE, 0))
        rule(refuse, "ioprio_set", sc.Arg(1, sc.NE, 0))
        # The no_core_dumps layer undone: a pipe's core-dump handler, which RLIMIT_CORE does not stop, would get it.
        rule(refuse, "prctl", sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, _PR_SET_DUMPABLE))
        # Typing into the terminal the host may share with the worker; a signal owner other than itself. The kernel
        # reads 32 bits of a command: the bits above them must not hide one.
        for request in (_TIOCSTI, _TIOCLINUX, *_SIGNAL_OWNER_IOCTLS):
            rule(refuse, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
        for command in _SIGNAL_OWNER_FCNTLS:
            for name in ("fcntl", "fcntl64"):  # fcntl64: 32-bit architectures only (libseccomp skips it elsewhere)
                rule(refuse, name, sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, command))
        future = 0
        if unified:
            for number in range(_NEWEST_KNOWN_SYSCALL + 1, 512):
                filt.add_rule(sc.ERRNO(errno.ENOSYS), number)
                future += 1
    except OSError as exc:
        raise _Unavailable(f"building the seccomp filter failed: {exc}") from exc
    detail = f"{len(set(refused))} syscalls refused or narrowed"
    if future:
        detail += f", numbers {_NEWEST_KNOWN_SYSCALL + 1}-511 answer ENOSYS"
    if unknown:
        detail += f"; unknown to this libseccomp and not filtered: {', '.join(unknown)}"
    return filt, detail


# ---------------------------------------------------------------- the layers


def _threads() -> list[str]:
    """The names of this process's threads."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            names.append(tid)
    return names


def _environment_block() -> tuple[int, int] | None:
    """Where the environment strings the kernel copied in at exec lie (/proc/PID/stat fields 50 and 51)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[47]), int(fields[48])
    except (OSError, IndexError, ValueError):
        return None


def _mount(source: str | None, target: str, kind: str | None, flags: int, options: str | None = None) -> None:
    def text(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    _check(_libc().mount(text(source), text(target), text(kind), flags, text(options)), f"mount({target})")


def _unshare_namespaces(network: bool) -> str:
    flags = _CLONE_NEWIPC | _CLONE_NEWNS | (0 if network else _CLONE_NEWNET)
    kinds = "IPC and mount" if network else "network, IPC and mount"
    if os.geteuid() == 0:
        try:
            _check(_libc().unshare(flags), "unshare")
            _own_mounts()
            return f"{kinds} (as root)"
        except OSError as exc:
            if exc.errno != errno.EPERM:
                raise _Unavailable(f"unshare({kinds}) failed: {exc}") from exc
            # root without CAP_SYS_ADMIN (a container): try a user namespace like anyone else
    uid, gid = os.getuid(), os.getgid()
    try:
        _check(_libc().unshare(_CLONE_NEWUSER | flags), "unshare")
    except OSError as exc:
        reasons = {
            errno.EPERM: "user namespaces are not allowed to this process (kernel.unprivileged_userns_clone, "
            "user.max_user_namespaces, an AppArmor or SELinux rule, or a container's seccomp profile)",
            errno.ENOSPC: "user.max_user_namespaces is exhausted",
            errno.EINVAL: "the kernel lacks user or network namespaces (CONFIG_USER_NS, CONFIG_NET_NS)",
            errno.EUSERS: "user namespaces are nested too deep",
        }
        raise _Unavailable(f"unshare(user, {kinds}) failed: {reasons.get(exc.errno or 0, exc)}") from exc
    for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{path}", "w") as mapping:
            mapping.write(text)
    _own_mounts()
    return f"user, {kinds} (uid {uid} mapped to itself)"


def _own_mounts() -> None:
    """Make every mount of the new mount namespace private: a mount made in it then never reaches the host's (as
    root, the copies of shared mounts would otherwise pass it on)."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)


def _set_rlimits(policy: SandboxPolicy, own_user_namespace: bool) -> str:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(usage.ru_utime + usage.ru_stime) + policy.cpu_seconds
    limits = {
        "AS": (policy.memory_bytes, policy.memory_bytes),
        "CPU": (cpu, cpu + 1),
        "NOFILE": (policy.open_files, policy.open_files),
        "FSIZE": (policy.file_bytes, policy.file_bytes),
    }
    notes = []
    if own_user_namespace or os.geteuid() == 0:
        limits["NPROC"] = (1 + policy.max_threads, 1 + policy.max_threads)
        if os.geteuid() == 0:
            notes.append("RLIMIT_NPROC is not enforced for root")
    else:
        notes.append("RLIMIT_NPROC left as it was: outside its own user namespace it counts all of the user's tasks")
    for name, (soft, hard) in limits.items():
        which = getattr(resource, f"RLIMIT_{name}")
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:
            hard = min(hard, old_hard)
        resource.setrlimit(which, (min(soft, hard), hard))
    text = ", ".join(f"{name} {soft}" for name, (soft, _) in limits.items())
    return f"{text}{'; ' if notes else ''}{'; '.join(notes)}"


def _no_core_dumps() -> str:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if _LINUX:
        _prctl(_PR_SET_DUMPABLE, 0, what="PR_SET_DUMPABLE")
        return "RLIMIT_CORE 0, not dumpable"
    return "RLIMIT_CORE 0"


def _empty_environment(policy: SandboxPolicy, block: tuple[int, int] | None) -> str:
    os.environ.clear()  # unsetenv()s each variable: the C environment too
    if os.name == "posix":
        import posix

        posix.environ.clear()  # the copy os.environ was made from
    scrubbed = ""
    if block is not None and block[1] > block[0]:
        ctypes.memset(block[0], 0, block[1] - block[0])
        scrubbed = f"; the {block[1] - block[0]}-byte block from exec zeroed"
    for name, value in policy.environment.items():
        os.environ[name] = value
    return f"{len(policy.environment)} variables set{scrubbed}"


def _check_workdir(workdir: str) -> None:
    try:
        if not os.path.isdir(workdir) or os.path.islink(workdir):
            raise SandboxError(f"workdir {workdir} is not a directory", "private_workdir")
        if os.listdir(workdir):
            raise SandboxError(f"workdir {workdir} is not empty", "private_workdir")
    except OSError as exc:
        raise SandboxError(f"workdir {workdir}: {exc}", "private_workdir") from exc


def _enter_workdir(policy: SandboxPolicy, own_mounts: bool) -> str:
    """Bound the private directory where the worker has mounts of its own, and make it the current directory."""
    bound = "its size unbounded (no mount namespace of its own)"
    if own_mounts:
        options = f"size={policy.folder_bytes},nr_inodes={policy.folder_files},mode=0700"
        _mount("pie-inferlet", policy.workdir, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options)
        bound = f"a tmpfs of {policy.folder_bytes} bytes and {policy.folder_files} files"
    os.chdir(policy.workdir)
    return f"cwd {policy.workdir}, {bound}"


def _drop_capabilities() -> str:
    libc = _libc()
    notes = []
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(libc.capget(ctypes.byref(header), data), "capget")
    had_setpcap = bool(data[0].effective & (1 << _CAP_SETPCAP))
    if had_setpcap:
        _prctl(_PR_SET_SECUREBITS, _SECUREBITS, what="PR_SET_SECUREBITS")
        cap = 0
        while _libc().prctl(_PR_CAPBSET_READ, cap, 0, 0, 0) >= 0:
            _prctl(_PR_CAPBSET_DROP, cap, what=f"PR_CAPBSET_DROP({cap})")
            cap += 1
        notes.append(f"bounding set emptied ({cap} capabilities)")
    else:
        notes.append("bounding set kept (no CAP_SETPCAP; nothing can exec to use it)")
    _check(libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "PR_CAP_AMBIENT_CLEAR_ALL")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    _check(libc.capset(ctypes.byref(header), (_CapData * 2)()), "capset")
    _check(libc.capget(ctypes.byref(header), data), "capget")
    if any(d.effective or d.permitted or d.inheritable for d in data):
        raise OSError(errno.EPERM, "capabilities are still held after capset")
    return "effective, permitted, inheritable, ambient cleared; " + "; ".join(notes)


def _no_new_privs() -> str:
    _prctl(_PR_SET_NO_NEW_PRIVS, 1, what="PR_SET_NO_NEW_PRIVS")
    if _prctl(_PR_GET_NO_NEW_PRIVS, what="PR_GET_NO_NEW_PRIVS") != 1:
        raise OSError(errno.EPERM, "no_new_privs did not stick")
    return "set"


def _build_ruleset(policy: SandboxPolicy) -> _Ruleset:
    abi = _landlock_abi()
    if abi < policy.min_landlock_abi:
        raise _Unavailable(f"the kernel's Landlock ABI is {abi}, the policy needs at least {policy.min_landlock_abi}")
    read = python_paths() if policy.read_only_paths is None else policy.read_only_paths
    try:
        ruleset = _Ruleset(abi, policy.network)
        for path in read:
            ruleset.allow_read(path)
        for path in _DEVICES_READ:
            if os.path.exists(path):
                ruleset.allow_read(path)
        for path in policy.writable_paths:  # (the private directory is allowed once it is entered: see _apply)
            ruleset.allow_write(path)
        for path in _DEVICES_WRITE:
            if os.path.exists(path):
                ruleset.allow_write(path)
    except OSError as exc:
        raise _Unavailable(f"building the Landlock ruleset failed: {exc}") from exc
    return ruleset


def _linux_only() -> _Unavailable:
    return _Unavailable(f"Linux only (this is {sys.platform})")


def _apply(policy: SandboxPolicy) -> dict[str, LayerStatus]:
    """Apply every layer it can, in order; raise SandboxError for a required one that cannot apply."""
    # Everything that needs /proc, the filesystem or CAP_SYS_ADMIN is gathered first, while it still works.
    known: dict[str, _Unavailable] = {}  # layers found unavailable before anything was applied
    required = frozenset(policy.required or ())
    if _LINUX:
        try:
            threads = _threads()
        except OSError as exc:
            raise SandboxError(f"cannot count this process's threads (is /proc mounted?): {exc}") from exc
        if len(threads) > 1:
            raise SandboxError(
                f"lock_down needs a single-threaded process, this one runs {len(threads)} threads "
                f"({', '.join(threads)}): namespaces, capabilities, no_new_privs and Landlock would not reach "
                "the threads already running. Start the worker with OPENBLAS_NUM_THREADS=1 and "
                "OMP_NUM_THREADS=1 and raise them after lock_down (threadpoolctl), start no thread before it."
            )
    _check_workdir(policy.workdir)
    for path in (*(policy.read_only_paths or ()), *policy.writable_paths):
        if not os.path.exists(path):
            raise SandboxError(f"the policy names {path}, which does not exist")
    if policy.keep_fds is not None:
        _close_other_fds(policy.keep_fds)
    block = _environment_block() if _LINUX else None
    ruleset: _Ruleset | None = None
    seccomp: tuple[object, str] | None = None
    if _LINUX:
        try:
            if "seccomp" in policy.layers:
                seccomp = _seccomp_filter(policy, os.getpid())
        except _Unavailable as exc:
            known["seccomp"] = exc
        try:
            if "landlock" in policy.layers:
                ruleset = _build_ruleset(policy)
        except _Unavailable as exc:
            known["landlock"] = exc
    else:
        for name in ("namespaces", "no_capabilities", "no_new_privs", "landlock", "seccomp"):
            known[name] = _linux_only()
    try:
        import resource  # noqa: F401
    except ImportError:
        known["rlimits"] = known["no_core_dumps"] = _Unavailable(f"no resource module on {sys.platform}")
    for name in LAYERS:
        if name in known and name in required:
            raise SandboxError(f"sandbox layer {name} is required but unavailable: {known[name]}", name)

    own_user_namespace = own_mounts = False

    def namespaces() -> str:
        nonlocal own_user_namespace, own_mounts
        detail = _unshare_namespaces(policy.network)
        own_user_namespace = detail.startswith("user")
        own_mounts = True
        return detail

    def landlock() -> str:
        assert ruleset is not None
        # The private directory as the worker now sees it: a rule names an inode, and the tmpfs mounted over the
        # directory has another than the directory under it.
        ruleset.allow_write(policy.workdir)
        ruleset.restrict_self()
        return ruleset.describe()

    def seccomp_layer() -> str:
        assert seccomp is not None
        seccomp[0].load()  # type: ignore[attr-defined]
        return seccomp[1]

    steps = {
        "namespaces": namespaces,
        "rlimits": lambda: _set_rlimits(policy, own_user_namespace),
        "no_core_dumps": _no_core_dumps,
        "empty_environment": lambda: _empty_environment(policy, block),
        "private_workdir": lambda: _enter_workdir(policy, own_mounts),
        "no_capabilities": _drop_capabilities,
        "no_new_privs": _no_new_privs,
        "landlock": landlock,
        "seccomp": seccomp_layer,
    }
    statuses: dict[str, LayerStatus] = {}
    for name in LAYERS:
        if name not in policy.layers:
            statuses[name] = LayerStatus(name, False, "left off by the policy")
            continue
        try:
            if name in known:
                raise known[name]
            statuses[name] = LayerStatus(name, True, steps[name]())
        except (_Unavailable, OSError, ValueError) as exc:
            if name in required:
                raise SandboxError(f"sandbox layer {name} failed: {exc}", name) from exc
            statuses[name] = LayerStatus(name, False, str(exc))
    return statuses


def _close_other_fds(keep: frozenset[int]) -> None:
    try:
        open_fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd" if _LINUX else "/dev/fd"))
    except OSError:
        open_fds = list(range(3, 1024))
    for fd in open_fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor of the directory listing itself, already closed


# ---------------------------------------------------------------- public entry points


def lock_down(policy: SandboxPolicy) -> list[str]:
    """Confine this process by ``policy``, for good; the names of the layers now active, in order.

    Raises :class:`SandboxError` when a layer in ``policy.required`` cannot be applied (before anything is
    applied where that is known in advance, as for a missing Landlock or libseccomp), or when the process
    is not fit to be locked down (it runs other threads; the working directory is not an empty directory).
    """
    return [name for name, status in _apply(policy).items() if status.available]


def probe_layers(timeout_s: float = 20.0) -> dict[str, LayerStatus]:
    """Which layers this machine can apply, each with what it does or why it cannot.

    Tried for real: a short-lived child interpreter (the same Python, the same ``sys.path``) locks itself
    down with a default policy that requires nothing, and reports each layer. Cheap enough for a server's
    start-up; this process is not touched.
    """
    import json
    import subprocess
    import tempfile

    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('pie_sandbox_probe', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "module._probe_main(sys.argv[2])\n"
    )
    path = os.pathsep.join(entry for entry in sys.path if entry)
    with tempfile.TemporaryDirectory(prefix="pie-sandbox-probe-") as workdir:
        try:
            done = subprocess.run(
                [sys.executable, "-c", code, os.path.abspath(__file__), workdir],
                env={"PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
                cwd=workdir,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            found = json.loads(done.stdout) if done.returncode == 0 else None
            why = f"the probe process exited with {done.returncode}: {done.stderr.strip()[-500:]}"
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            found, why = None, f"the probe process failed: {exc}"
    if found is None:
        return {name: LayerStatus(name, False, why) for name in LAYERS}
    return {name: LayerStatus(name, bool(found[name][0]), str(found[name][1])) for name in LAYERS}


def describe_layers(statuses: Mapping[str, LayerStatus]) -> str:
    """One line for a server's start-up: the active layers, then each unavailable one with its reason."""
    active = [name for name, status in statuses.items() if status.available]
    missing = [f"{name} ({status.detail})" for name, status in statuses.items() if not status.available]
    text = f"sandbox layers active: {', '.join(active) or 'none'}"
    return text + (f"; unavailable: {'; '.join(missing)}" if missing else "")


def _probe_main(workdir: str) -> None:
    """In the probe's child: lock down with a policy that requires nothing, print every layer as JSON."""
    import json

    statuses = _apply(SandboxPolicy(workdir=workdir, required=frozenset()))
    sys.stdout.write(json.dumps({name: [status.available, status.detail] for name, status in statuses.items()}))
