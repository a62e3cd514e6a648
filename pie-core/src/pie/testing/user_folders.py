"""A pytest plugin that gives the test process user state of its own: ``pytest -p pie.testing.user_folders``.

Pie keeps state per user: device claims (see :mod:`pie.device_use`), profiles in the config folder, crash logs in
the state folder. Test processes running side by side (pytest-xdist's workers) would see each other's state there:
a server one worker's test starts claims the device that another's `pie tune` measures, a profile one test writes
is the one another reads. Each process gets an empty claims folder and XDG config and state folders of its own,
which the servers and commands its tests start inherit, and a developer's own are left untouched.

The cache folder stays the user's, shared: it holds only caches (the model store, pie's probe results and kernel
compile caches, Mesa's shader cache, PoCL's), each safe for several processes at once, which are then filled once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pie.device_use import CLAIMS_DIR_ENV

OWN_FOLDERS = {CLAIMS_DIR_ENV: "device-claims", "XDG_CONFIG_HOME": "config", "XDG_STATE_HOME": "state"}
"""Each variable set for the process, to its own folder of this name."""
ROOT_VARIABLE = "PYTEST_PIE_USER_FOLDERS"
"""The folder that holds every process's folders, made by the first process (xdist's controller) and removed by it:
a worker's own end comes too late to count on (the controller shuts it down once its tests are done)."""

_made: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        root = Path(tempfile.mkdtemp(prefix="pie-user-folders-"))
        os.environ[ROOT_VARIABLE] = str(root)
        _made.append(root)
    own = Path(os.environ[ROOT_VARIABLE]) / (worker or "main")
    for variable, name in OWN_FOLDERS.items():
        folder = own / name
        folder.mkdir(parents=True)
        os.environ[variable] = str(folder)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)
        del os.environ[ROOT_VARIABLE]
