"""Programs compiled once per machine, not once per process: JAX's own persistent compilation cache, kept in the
engine kit's cache folder for this engine (``PIE_XLA_CACHE_DIR``, else ``<user cache>/pie/xla-kernels``).

A server's first requests compile every shape bucket they meet, a few seconds each on a CPU; with the cache a
restarted server (or the next ``pie run``) loads them instead. JAX keys each entry on the program, its compile
options and the backend's version. ``PIE_XLA_CACHE=0`` turns it off, and a cache folder the user gave JAX itself
(``JAX_COMPILATION_CACHE_DIR``) is left as it is. A folder that cannot be made or written leaves the cache off with
one warning (JAX would warn at every compile).
"""

from __future__ import annotations

import logging
import os
from functools import cache

from pie.enginekit.compile_cache import cache_enabled_env, default_cache_dir

ENGINE = "xla"
log = logging.getLogger("pie.engine.xla")


@cache
def use_persistent_cache() -> str:
    """Turn JAX's persistent cache on (once, before the first compile); the folder it uses, or why none."""
    import jax

    if os.environ.get(cache_enabled_env(ENGINE), "1").strip().lower() in ("0", "false", "no"):
        return f"off ({cache_enabled_env(ENGINE)}=0)"
    given = jax.config.jax_compilation_cache_dir
    if given:
        return f"{given} (JAX's own setting)"
    folder = default_cache_dir(ENGINE)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder} is not writable")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        log.warning("the XLA compile cache %s cannot be used (%s): every program compiles in each process", folder,
                    reason)
        return f"off ({folder}: {reason})"
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # a bucket's program takes about 0.5 s
    return str(folder)
