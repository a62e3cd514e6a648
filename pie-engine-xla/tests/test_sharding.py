"""Tensor parallelism on 2 and 4 host devices (subprocesses: XLA_FLAGS must be set before jax loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run_sharded(devices: int) -> dict:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        PIE_XLA_DEVICES=str(devices),
        JAX_PLATFORMS="cpu",
    )
    done = subprocess.run(
        [sys.executable, str(HERE / "sharded_run.py")], env=env, cwd=HERE, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("devices", [2, 4])
def test_tensor_parallel_logits_match_cpu(devices: int) -> None:
    report = run_sharded(devices)
    assert report["jax_devices"] == 4 and report["mesh_devices"] == devices
    assert report["max_error"] < 1e-4
    assert report["pool_error"] < 1e-5
    assert report["odd_max_error"] < 1e-4
    assert report["top_k_matches_cpu"], "top_k over the vocab-parallel logits differs from the CPU engine's"

    weights = report["weights"]
    # Column-parallel QKV and gate/up (rows split), row-parallel o and down (columns split), vocab-parallel head.
    assert weights["w.L0.qkv"] == {"spec": ["model", None], "shard": [(128 + 64 + 64) // devices, 64]}
    assert weights["w.L0.gate_up"] == {"spec": ["model", None], "shard": [256 // devices, 64]}
    assert weights["w.L0.o"] == {"spec": [None, "model"], "shard": [64, 128 // devices]}
    assert weights["w.L0.down"] == {"spec": [None, "model"], "shard": [64, 128 // devices]}
    assert weights["w.lm_head"]["shard"] == [400 // devices, 64]
    # The KV pool is split by KV head: [layers, pages, 2, page_size, heads, head_dim].
    assert report["pool"]["spec"][4] == "model" and report["pool"]["shard"][4] == 4 // devices

    # As Q4_1 (20 bytes a block of 32 columns), the same layout over byte rows and whole blocks of columns.
    assert report["stored_max_error"] < 1e-4
    stored = report["stored_weights"]
    assert stored["w.L0.qkv"] == {"spec": ["model", None], "shard": [(128 + 64 + 64) // devices, 2 * 20]}
    assert stored["w.L0.o"] == {"spec": [None, "model"], "shard": [64, 128 // 32 // devices * 20]}
    assert stored["w.L0.down"] == {"spec": [None, "model"], "shard": [64, 128 // 32 // devices * 20]}

    collectives = report["collectives"]
    # Heads stay on their device from QKV through attention; XLA all-reduces only the row-parallel projections.
    for region in ("attn_in", "attention", "mlp_in"):
        assert not any(collectives[region].values()), (region, collectives[region])
    assert collectives["attn_out"]["all-reduce"] >= 1 and collectives["mlp_out"]["all-reduce"] >= 1
