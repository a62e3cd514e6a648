"""Cost of the plugin layer per kernel launch, next to a direct call of the same kernel.

    python benchmarks/plugin_overhead.py

Prints medians over several timeit runs, in nanoseconds per launch:
- kernel function: the CPU engine's numpy function alone;
- engine's launcher: what the engine's ``pie_compile_kernel`` returned, its argument checks
  (``pie.enginekit.catalogue``) in front of that function: the base the plugin layer is measured from;
- bound: the launcher `Device.compile` returned (what the runtime calls every launch);
- plan step: one step of `Plan.run`'s loop around the same launcher (slot lookups included);
- unbound hook: going through pluggy on every launch, the design the contract avoids.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import statistics
import timeit

import numpy as np
from pie.contract import KernelRequest
from pie.plugins import EngineRegistry
from pie.poem.graph import Graph
from pie.poem.lower import lower
from pie_engine_cpu import kernels

REPEATS, NUMBER = 9, 200_000


def per_call_ns(fn) -> float:
    runs = timeit.repeat(fn, number=NUMBER, repeat=REPEATS)
    return statistics.median(runs) / NUMBER * 1e9


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # no options: --help, or an error
    device = EngineRegistry().select("cpu")[0]
    a = np.ones((1, 1), np.float32)
    b = np.ones((1, 1), np.float32)
    bound = device.compile("add")
    hook = device.engine._hook
    request = KernelRequest("add")
    engine_launcher = hook.pie_compile_kernel(device=device.info, request=request)

    graph = Graph()
    graph.add("add", ("in.a", "in.b"), "logits", "bench")
    plan = lower(graph, device)
    env = plan.new_env()
    plan.bind(env, "in.a", a)
    plan.bind(env, "in.b", b)

    kernel = per_call_ns(lambda: kernels.add(a, b))
    direct = per_call_ns(lambda: engine_launcher(a, b))
    via_bound = per_call_ns(lambda: bound(a, b))
    via_plan = per_call_ns(lambda: plan.run(env))
    unbound = per_call_ns(lambda: hook.pie_compile_kernel(device=device.info, request=request)(a, b))
    print(f"kernel function    {kernel:8.0f} ns")
    print(f"engine's launcher  {direct:8.0f} ns  (its argument checks {direct - kernel:+.0f} ns)")
    print(f"bound launcher     {via_bound:8.0f} ns  (overhead {via_bound - direct:+.0f} ns; goal <= 1000)")
    print(f"plan step          {via_plan:8.0f} ns  (overhead {via_plan - direct:+.0f} ns per launch, whole run loop)")
    print(f"unbound pluggy     {unbound:8.0f} ns  (overhead {unbound - direct:+.0f} ns: why launches are bound once)")


if __name__ == "__main__":
    main()
