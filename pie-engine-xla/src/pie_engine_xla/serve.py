"""`pie serve` over the XLA engine on several processes: the same command on every host of the group.

    python -m pie_engine_xla.serve --model M [--coordinator HOST:PORT --num-processes N --process-id I]
                                   [--pass-address HOST:PORT] [--host H --port P --kv-tokens T ...]

Every process joins the JAX runtime (:func:`pie_engine_xla.distributed.initialize`; without the
flags, the JAX_* variables or JAX's own detection on a TPU pod) and loads the model on the mesh
of all of them. Rank 0 serves the OpenAI-compatible API (:func:`pie.serve.server.run_server`)
and leads; the others follow its passes and exit when it does. A SIGTERM to rank 0 drains it
as it drains `pie serve`; a follower that loses its leader exits 1.
"""

from __future__ import annotations

import argparse
import sys

from pie_engine_xla.distributed import Leader, ProcessGroup, follow, initialize, shutdown


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pie_engine_xla.serve", description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("the process group (default: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                                      "JAX_PROCESS_ID, or JAX's detection)")
    group.add_argument("--coordinator", help="HOST:PORT of process 0's JAX coordinator")
    group.add_argument("--num-processes", type=int)
    group.add_argument("--process-id", type=int)
    group.add_argument("--pass-address", help="HOST:PORT where rank 0 takes the followers (default: coordinator port + 1)")
    serve = parser.add_argument_group("serving (as pie serve; rank 0 only listens)")
    serve.add_argument("--model", help="model name or path, the same on every host")
    serve.add_argument("--served-model-name")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--kv-tokens", type=int, help="KV cache size in tokens (default: a share of the memory)")
    serve.add_argument("--kv-memory-share", type=float, default=0.25)
    serve.add_argument("--max-running", type=int, default=64)
    serve.add_argument("--max-waiting", type=int, default=256)
    serve.add_argument("--drain-seconds", type=float, default=30.0)
    serve.add_argument("--no-prefix-cache", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pie.runtime.llm import LLM
    from pie.serve.app import ServeSettings

    group = initialize(args.coordinator, args.num_processes, args.process_id, args.pass_address)
    settings = ServeSettings(
        model=args.model, engine="xla", served_model_name=args.served_model_name, kv_tokens=args.kv_tokens,
        kv_memory_share=args.kv_memory_share, max_running=args.max_running, max_waiting=args.max_waiting,
        drain_seconds=args.drain_seconds, prefix_caching=not args.no_prefix_cache,
    )

    def load(settings: ServeSettings) -> LLM:
        # Every rank loads alike: the same runner, the same pool, the same programs in the same order.
        share = settings.kv_memory_share if settings.kv_tokens is None else None
        return LLM.load(settings.model, "xla", max_cached_tokens=settings.kv_tokens, kv_memory_share=share)

    if group.num_processes > 1 and not group.leads:
        return _follow(load(settings), group)
    leaders: list[Leader] = []

    def load_and_lead(settings: ServeSettings) -> LLM:
        llm = load(settings)
        if group.num_processes > 1:
            leaders.append(Leader(llm.runner, group))
        return llm

    from pie.serve.server import run_server

    try:
        code = run_server(settings, args.host, args.port, load=load_and_lead)
    finally:
        for leader in leaders:
            leader.close()
    if group.num_processes > 1:
        shutdown()
    return code


def _follow(llm: object, group: ProcessGroup) -> int:
    runner = llm.runner  # type: ignore[attr-defined]
    try:
        ran = follow(runner, group)
    except ConnectionError as exc:
        print(f"pie_engine_xla.serve: process {group.process_id}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"pie_engine_xla.serve: process {group.process_id}: the leader closed after {ran} operation(s)",
          file=sys.stderr, flush=True)
    runner.close()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
