"""The host facts of `pie.enginekit.host` that the CPU engine builds and sizes its native kernels by."""

from __future__ import annotations

import os
import platform

import pytest
from pie.enginekit import host


def test_the_cpu_identity_names_the_machine_and_every_flag() -> None:
    identity = host.cpu_identity()
    assert identity.split(" ")[0] == platform.machine()
    assert set(identity.split(" ")[1:]) - {""} == set(host.cpu_flags())


def test_a_field_cpuinfo_lacks_reads_empty() -> None:
    assert host.cpuinfo_field("no such field") == ""
    assert host.cpu_name() and host.cpu_vendor()


def test_usable_cpus_is_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3}, raising=False)
    assert host.usable_cpus() == 2
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert host.usable_cpus() == 6
