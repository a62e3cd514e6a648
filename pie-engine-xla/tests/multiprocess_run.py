"""Run by test_multiprocess.py: one process of a two-process XLA engine.

    python multiprocess_run.py MODEL PROCESS_ID COORDINATOR PASS_ADDRESS

MODEL is ``tiny`` (a random Llama whose heads, MLP and vocabulary divide over 2 devices: every
step's logits and the KV pool are reported; test_multiprocess.py runs the same workload in its own
process for reference) or ``smollm2`` (the greedy tokens). Rank 0 prints one JSON line; the follower
prints how many operations it ran.
"""

from __future__ import annotations

import json
import socket
import sys

import numpy as np


def tiny_runner(device):  # type: ignore[no-untyped-def]
    from pie.runtime.model_runner import ModelRunner
    from pie.testing.models import random_weights
    from xla_helpers import sharding_config

    config = sharding_config()
    return ModelRunner(config, random_weights(config, 0).items(), device, page_size=4, max_cached_tokens=512)


def tiny_workload(runner) -> dict:  # type: ignore[no-untyped-def]
    """A ragged prefill, a fork whose first write copies a shared page, decode steps, the pool read back.

    The tokens fed are fixed (not each run's own argmax), so the runs compared see the same inputs."""
    from pie.runtime.model_runner import SequenceWork

    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size
    sequences = [runner.new_sequence() for _ in range(2)]
    prompts = [[int(t) for t in rng.integers(0, vocab, n)] for n in (7, 3)]
    steps = [runner.step([SequenceWork(s, p) for s, p in zip(sequences, prompts)])]
    sequences.append(sequences[0].fork())  # 7 tokens in pages of 4: the fork shares a half-full page
    for _ in range(5):
        tokens = [[int(t)] for t in rng.integers(0, vocab, len(sequences))]
        steps.append(runner.step([SequenceWork(s, t) for s, t in zip(sequences, tokens)]))
    pages = np.arange(runner.layout.num_pages, dtype=np.int32)
    pool = runner.pages.read(pages)
    qkv = runner._env[runner.plan.slots["w.L0.qkv"]].array
    return {
        "logits": [step.tolist() for step in steps],
        "pool_sum": float(np.abs(pool).sum()),
        "pool_max": float(np.abs(pool).max()),
        "qkv_shard": list(qkv.addressable_shards[0].data.shape),
        "qkv_shape": list(qkv.shape),
    }


def main() -> None:
    model, role, coordinator, pass_address = sys.argv[1:]
    from pie.runtime.replicated import Leader, follow, split_address
    from pie_engine_xla.distributed import initialize, shutdown

    group = initialize(coordinator, 2, int(role))
    address = split_address(pass_address)

    import jax
    from pie.plugins import EngineRegistry
    from pie.runtime.model_runner import ModelRunner

    device = EngineRegistry().engine("xla").open(0)
    if model == "tiny":
        runner = tiny_runner(device)
    else:
        from pie.model.loader import load_model
        from pie.model.store import resolve_model

        loaded = load_model(resolve_model(None))
        runner = ModelRunner(loaded.config, loaded.tensors(), device, max_cached_tokens=256)

    if not group.leads:
        ran = follow(runner, group, address)
        runner.close()
        shutdown()
        print(json.dumps({"followed": ran}))
        return

    leader = Leader(runner, group, socket.create_server(address))
    if model == "tiny":
        report = tiny_workload(runner)
    else:
        from xla_helpers import smollm2_workload

        report = {"tokens": smollm2_workload(runner, loaded.tokenizer)[0]}
    info = dict(device.info.extra)
    report.update(processes=int(info["processes"]), mesh_devices=int(info["mesh_devices"]),
                  jax_processes=jax.process_count())
    leader.close()
    runner.close()
    shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
