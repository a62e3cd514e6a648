"""Finding a Chromium-family browser on this machine, for an engine whose device is a page in one.

Nothing here is about one engine or its page: which browser to run (named, or the first found), whether it
runs at all (``--version``, bounded), whether a DevTools endpoint to attach to is on this machine, what a
launch that failed said. Nothing is started but
``--version``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import util
from urllib.parse import urlsplit

COMMANDS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
"""Commands looked up on PATH, in order, when no browser is named."""
MAC_APPS = (
    "/Applications/Chromium.app/Contents/MacOS/Chromium",
    "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",
)
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


class BrowserUnavailable(RuntimeError):
    """No browser device here; ``fix`` says how to get one. ``setting``: the reason is a variable of the user's
    that the engine cannot read or that names nothing here, so a browser device asked for is an
    :class:`pie.plugins.EngineSettingError` (the user's to correct, not a reason to run another engine)."""

    def __init__(self, reason: str, fix: str = "", setting: bool = False):
        super().__init__(reason)
        self.fix = fix
        self.setting = setting


def browser_fix() -> str:
    if sys.platform.startswith("linux"):
        return "sudo apt-get install chromium"
    return "install Chromium or Google Chrome"


def installed(name: str) -> bool:
    """Whether the module ``name`` can be imported (found without importing it)."""
    try:
        return util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def find_executable(chosen: str, variable: str) -> str:
    """The browser ``chosen`` names (a path, or a command on PATH), or where it is empty the first of
    :data:`COMMANDS` on PATH (then a macOS app); ``variable`` is where ``chosen`` came from, for the error."""
    if chosen:
        executable = chosen if os.sep in chosen else shutil.which(chosen)
        if not executable or not os.access(executable, os.X_OK) or os.path.isdir(executable):
            raise BrowserUnavailable(f"{variable}={chosen}: no such executable", browser_fix(), setting=True)
        return executable
    found = [shutil.which(command) for command in COMMANDS]
    found += [path for path in MAC_APPS if sys.platform == "darwin" and os.access(path, os.X_OK)]
    executable = next((path for path in found if path), "")
    if not executable:
        raise BrowserUnavailable(f"no Chromium-family browser found ({', '.join(COMMANDS)})", browser_fix())
    return executable


def browser_version(executable: str) -> str:
    """What the browser says it is (``Chromium 156.0.8078.114``), which also shows that it runs at all."""
    try:
        run = subprocess.run(
            [executable, "--version"], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BrowserUnavailable(f"{executable} --version failed: {exc}", browser_fix()) from exc
    lines = [line.strip() for line in run.stdout.splitlines() if line.strip()]
    if run.returncode != 0 or not lines:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise BrowserUnavailable(f"{executable} --version exited with {run.returncode}: {last}", browser_fix())
    return re.sub(r"\s+built on .*$", "", lines[0])


def check_devtools_endpoint(url: str, variable: str) -> None:
    """BrowserUnavailable unless ``url`` (from ``variable``) is an http or ws address on this machine."""
    host = urlsplit(url).hostname or ""
    if urlsplit(url).scheme not in ("http", "ws") or host not in LOOPBACK:
        raise BrowserUnavailable(
            f"{variable}={url!r} is not a DevTools endpoint on this machine "
            "(http://127.0.0.1:PORT of a browser started with --remote-debugging-port=PORT)",
            setting=True,
        )


def launch_failure(exc: Exception, executable: str, cdp_url: str = "", lines: int = 4) -> str:
    """One line for a browser that did not start (or could not be attached to at ``cdp_url``): playwright's
    first line and the last ``lines`` of what the browser wrote to stderr (playwright's own message goes on
    with its whole command line and call log)."""
    text = str(exc)
    first = (text.strip().splitlines() or [type(exc).__name__])[0]
    said = list(dict.fromkeys(re.findall(r"^\s*(?:- )?\[pid=\d+\]\[err\] (.+)$", text, re.MULTILINE)))
    where = f"attaching to {cdp_url}" if cdp_url else f"{executable} did not start"
    return f"{where} ({first})" + (f"; it said: {' | '.join(said[-lines:])}" if said else "")
