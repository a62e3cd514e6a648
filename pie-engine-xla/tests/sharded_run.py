"""Run in a subprocess by test_sharding.py: XLA_FLAGS must give jax several host devices before it loads.

Prints one JSON line: logits errors against the CPU engine and where the weights, pool and
collectives ended up.
"""

from __future__ import annotations

import inspect
import json
import re

import jax
import numpy as np
from pie.runtime.model_runner import SequenceWork
from pie.testing.models import tiny_config
from xla_helpers import compare_engines, pool_contents, sharding_config

COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")


def _placement(runner, name):
    tensor = runner._env[runner.plan.slots[name]]
    return _where(tensor.array)


def _where(array):
    return {"spec": list(array.sharding.spec), "shard": list(array.addressable_shards[0].data.shape)}


def _top_k_matches(cpu, xla) -> bool:
    """The vocab-parallel logits' top_k, selected on the mesh, against the CPU engine's."""
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    tops = [r.forward_top(r.prepare([SequenceWork(r.new_sequence(), p) for p in prompts]), 8) for r in (cpu, xla)]
    return bool(np.array_equal(tops[0].indices, tops[1].indices)) and bool(
        np.allclose(tops[0].values, tops[1].values, rtol=1e-4, atol=1e-4)
    )


def main() -> None:
    report: dict = {"jax_devices": len(jax.devices())}
    result = compare_engines(sharding_config(), fork=True, decode_steps=5)
    xla = result.runners["xla"]
    report["mesh_devices"] = int(dict(xla.device.info.extra)["mesh_devices"])
    report["max_error"] = result.max_error
    report["pool_error"] = float(abs(pool_contents(xla) - pool_contents(result.runners["cpu"])).max())
    names = ("w.L0.qkv", "w.L0.o", "w.L0.gate_up", "w.L0.down", "w.lm_head")
    report["weights"] = {name: _placement(xla, name) for name in names}
    report["pool"] = _where(xla.pages.handle.array)
    collectives = {}
    for step in xla.plan.steps:
        text = inspect.unwrap(step.launcher).program.optimized_hlo() or ""
        found = {c: len(re.findall(rf"= \S+ {c}(-start)?\(", text)) for c in COLLECTIVES}
        collectives[step.region.split(".", 1)[-1]] = found
    report["collectives"] = collectives
    report["top_k_matches_cpu"] = _top_k_matches(result.runners["cpu"], xla)
    result.close()
    # Heads and MLP that do not divide over the mesh: replicated where needed, still exact.
    odd_config = tiny_config(num_heads=6, num_kv_heads=3, intermediate_size=100, vocab_size=401)
    odd = compare_engines(odd_config, decode_steps=3)
    report["odd_max_error"] = odd.max_error
    odd.close()
    # Weights kept as Q4_1 bytes: byte rows permuted and sharded, byte columns sharded at block boundaries.
    stored = compare_engines(sharding_config(), decode_steps=3, weight_type="q4_1")
    report["stored_max_error"] = stored.max_error
    report["stored_weights"] = {name: _placement(stored.runners["xla"], name) for name in names}
    stored.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
