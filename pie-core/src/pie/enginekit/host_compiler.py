"""Shared libraries built on this machine by its C or C++ compiler, through an engine's compile cache.

An engine whose kernels are native code on the host (the CPU engine's ``native.c``) finds the compiler,
keys the build on everything that shapes the machine code, and loads the cached library; a new compiler or
CPU never reuses a stale build, and a damaged one is never loaded (`pie.enginekit.compile_cache`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from pie.enginekit.compile_cache import CompileCache, cache_dir_env, cache_key

C_COMPILERS = ("cc", "gcc", "clang")
INSTALL_COMPILER = "install a C compiler (apt-get install gcc), or name one in $CC"
"""The fix where no compiler is found."""


class HostBuildError(RuntimeError):
    """A shared library cannot be built or loaded here: no compiler, one that cannot run, one that
    rejects the source, or nowhere to build. ``fix`` says what to do about this cause."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


def find_compiler(variable: str = "CC", names: tuple[str, ...] = C_COMPILERS) -> str | None:
    """The compiler to use: the one ``$variable`` names, else the first of ``names`` on ``PATH``."""
    configured = os.environ.get(variable)
    if configured:
        return shutil.which(configured) or configured
    return next((found for name in names if (found := shutil.which(name))), None)


def compiler_identity(compiler: str) -> str:
    """What ``compiler --version`` says: part of every build's key."""
    fix = "name a working C compiler in $CC (or unset it), or install one (apt-get install gcc)"
    try:
        run = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise HostBuildError(f"compiler {compiler!r} cannot run: {error}", fix) from error
    if run.returncode != 0:
        said = run.stderr.strip().splitlines()
        raise HostBuildError(f"compiler {compiler!r} does not work: `{compiler} --version` exited with "
                             f"{run.returncode}{': ' + said[-1][:300] if said else ''}", fix)
    return run.stdout + run.stderr


def build_shared_library(
    source: str,
    file_name: str,
    flags: tuple[str, ...],
    arch: str,
    cache: CompileCache,
    compiler: str | None = None,
    libraries: tuple[str, ...] = (),
    fresh: bool = False,
) -> Path:
    """``source``, saved as ``file_name`` (its suffix tells the compiler the language), compiled with
    ``flags`` into a shared library in ``cache``, or the one already built for it there (unless ``fresh``:
    the one there does not load, see :meth:`CompileCache.get_or_compile`).

    The key covers the source, the compiler's identity, ``arch`` (what the host's CPU is, for flags such
    as ``-march=native``) and the flags. The compiler runs in a scratch folder of the cache. ``compiler``
    defaults to :func:`find_compiler`'s; ``libraries`` follow the source on the command line (``-lm``).
    """
    compiler = compiler or find_compiler()
    if compiler is None:
        raise HostBuildError(f"no C compiler found (looked for $CC, {', '.join(C_COMPILERS)})", INSTALL_COMPILER)
    key = cache_key(source=source, compiler=compiler, compiler_version=compiler_identity(compiler), arch=arch,
                    options=(*flags, *libraries))

    def compile_source() -> dict[str, bytes]:
        with cache.scratch() as scratch:
            source_path, built = scratch / file_name, scratch / "library.so"
            source_path.write_text(source)
            run = subprocess.run([compiler, *flags, str(source_path), "-o", str(built), *libraries],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise HostBuildError(
                    f"the compiler rejected {file_name} ({compiler} {' '.join(flags)}):\n{run.stderr.strip()[-2000:]}",
                    "name another C compiler in $CC",
                )
            return {"so": built.read_bytes()}

    try:
        return cache.file(key, "so", compile_source, fresh)
    except OSError as error:
        raise HostBuildError(f"{file_name} cannot be built: {error}", "free some disk space, or name a writable "
                             f"folder in {cache_dir_env(cache.engine)} or TMPDIR") from error
