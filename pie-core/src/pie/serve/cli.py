"""`pie serve`: the command. It imports the server's libraries only when run, so `pie` works without them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from pie.cli_errors import fail, usage
from pie.contract import KvDtype
from pie.files import read_regular_file
from pie.serve import SERVE_EXTRA_HINT
from pie.weights import Dtype

if TYPE_CHECKING:
    from pie.runtime.llm import LLM
    from pie.serve.app import ServeSettings

API_KEY_ENV = "PIE_API_KEY"
SERVE_LIBRARIES = ("fastapi", "uvicorn", "httptools", "prometheus_client")
"""httptools too: the server's bounded connections are uvicorn's httptools protocol (:mod:`pie.serve.connection`)."""
RAY_LIBRARIES = ("ray", "aiohttp")
LEAST_AIOHTTP = (3, 12)
"""The ingress passes aiohttp's ``socket_factory`` (3.12 and later) for its upstream connections' keepalive."""
GROUP_PANEL = "One model over several processes"


def serve_command(
    model: Annotated[Optional[str], typer.Option(help="Model name or path (default: the embedded default).")] = None,
    engine: Annotated[Optional[str], typer.Option(help="Engine (default: PIE_ENGINES or the best available).")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: any free one; the address is printed).")] = 8000,
    served_model_name: Annotated[
        Optional[str], typer.Option(help="The model's name in the API (default: what --model says).")
    ] = None,
    api_key_file: Annotated[
        Optional[Path], typer.Option(help=f"File holding the API key clients must send (or set {API_KEY_ENV}).")
    ] = None,
    protect_probes: Annotated[
        bool, typer.Option("--protect-probes", help=(
            "Ask for the API key on what answers without it otherwise: /health, /metrics, /openapi.json, "
            "/v1/pie/status, /v1/pie/plan, and the page (/ and /ui/*; a browser asks for it as a password)."))
    ] = False,
    kv_tokens: Annotated[
        Optional[int], typer.Option(help=(
            "KV cache size in tokens (default: --kv-memory-share of the device's memory, at most 256 contexts; one "
            "context where the engine does not know its memory; on Vulkan and WebGPU no more than one layer's "
            "binding holds)."))
    ] = None,
    kv_memory_share: Annotated[
        float, typer.Option(help="Share of the device's memory the KV cache takes when --kv-tokens is not given.")
    ] = 0.25,
    kv_dtype: Annotated[KvDtype, typer.Option(help="Element type of the KV cache's pages.")] = "float32",
    host_kv_tokens: Annotated[int, typer.Option(
        help="Host memory, in KV tokens, that the pages of requests preempted for lack of KV pages are copied to "
        "(0: a preempted request recomputes its KV when it resumes).")] = 0,
    dtype: Annotated[Dtype, typer.Option(
        help="The type the model's matrices load in: auto keeps its files' types; float32, float16 and bfloat16 "
        "convert its float matrices (a block-quantized one to float32 only).")] = "auto",
    max_running: Annotated[int, typer.Option(help="Requests generating at once; more wait.")] = 64,
    max_waiting: Annotated[int, typer.Option(
        help="Requests that may wait (each prompt of a completions batch is one); more are answered 503.")] = 256,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body; larger ones are answered 413.")] = 8 << 20,
    drain_seconds: Annotated[
        float, typer.Option(help="On SIGTERM or Ctrl-C, how long requests in flight may run on.")
    ] = 30.0,
    stall_seconds: Annotated[Optional[float], typer.Option(
        help="How long one engine step (one batched forward pass) may run before the server "
        "counts as stalled (a kernel or the device hangs): /health answers 503 and new requests are refused "
        "(code engine_stalled) until the step returns. Default: 600.")] = None,
    prefix_cache: Annotated[
        bool, typer.Option("--prefix-cache/--no-prefix-cache", help="Reuse the KV pages of shared prompt prefixes.")
    ] = True,
    inferlets: Annotated[
        Optional[Path], typer.Option(help="Folder of inferlets (files or packages) to serve at /v1/inferlets.")
    ] = None,
    allow_uploads: Annotated[
        bool, typer.Option("--allow-uploads", help="Run inferlet source clients send (sandboxed; needs every layer).")
    ] = False,
    inferlet_workers: Annotated[int, typer.Option(help="Inferlet worker processes kept started.")] = 2,
    runs_per_worker: Annotated[
        Optional[int],
        typer.Option(help="Runs of one installed inferlet a worker serves in turn, after runs that ended cleanly "
                     "(1: a new process for every run; uploads always get one). Default: 64."),
    ] = None,
    max_inferlet_runs: Annotated[int, typer.Option(
        help="Inferlet runs at once, an upload's from when its source is checked; more are answered 503.")] = 16,
    inferlet_token_budget: Annotated[int, typer.Option(help="Tokens one inferlet run's passes may take.")] = 100_000,
    inferlet_seconds: Annotated[float, typer.Option(help="Wall-clock seconds one inferlet run may take.")] = 300.0,
    access_log: Annotated[bool, typer.Option("--access-log", help="Log every HTTP request.")] = False,
    allowed_origin: Annotated[Optional[list[str]], typer.Option(
        metavar="ORIGIN", help="A web page's origin (https://app.example.com) whose scripts may call the API from a "
        "browser (CORS); may be repeated; '*' for any, only with an API key.")] = None,
    ui: Annotated[
        bool, typer.Option("--ui/--no-ui", help="Serve the web page at / (a chat playground, the runtime live).")
    ] = True,
    ray: Annotated[
        Optional[str],
        typer.Option("--ray", metavar="ADDRESS", rich_help_panel="Replicas on Ray",
                     help="Serve through replicas on a Ray cluster behind this process: 'auto' (the cluster of "
                     "RAY_ADDRESS or `ray start` here), 'local' (a new Ray instance on this machine) or an address."),
    ] = None,
    replicas: Annotated[
        Optional[int], typer.Option(rich_help_panel="Replicas on Ray", help="Replicas (default: one per node).")
    ] = None,
    replica_cpus: Annotated[float, typer.Option(rich_help_panel="Replicas on Ray", help="CPUs each replica holds.")] = 1.0,
    replica_gpus: Annotated[float, typer.Option(rich_help_panel="Replicas on Ray", help="GPUs each replica holds.")] = 0.0,
    replica_pin_cores: Annotated[
        bool, typer.Option("--replica-pin-cores", rich_help_panel="Replicas on Ray",
                           help="Hold replica i to cores i*CPUS.. of its host (several replicas on one host).")
    ] = False,
    replica_resource: Annotated[
        Optional[list[str]],
        typer.Option(rich_help_panel="Replicas on Ray", help="Another Ray resource each replica holds, NAME=AMOUNT "
                     "(e.g. TPU=4); may be repeated."),
    ] = None,
    process_group: Annotated[
        bool, typer.Option("--process-group", rich_help_panel=GROUP_PANEL,
                           help="Serve one model over the devices of several processes, the same command on every "
                           "host: --engine's group, as the options below say or as the engine finds it itself "
                           "(its environment variables, a TPU pod). Rank 0 serves and leads; the others follow "
                           "its passes and exit when it does."),
    ] = False,
    coordinator: Annotated[Optional[str], typer.Option(
        rich_help_panel=GROUP_PANEL, metavar="HOST:PORT", help="Process 0's coordinator (implies --process-group).")
    ] = None,
    num_processes: Annotated[Optional[int], typer.Option(
        rich_help_panel=GROUP_PANEL, help="Processes in the group (implies --process-group).")] = None,
    process_id: Annotated[Optional[int], typer.Option(
        rich_help_panel=GROUP_PANEL, help="This process's rank (implies --process-group).")] = None,
    pass_address: Annotated[Optional[str], typer.Option(
        rich_help_panel=GROUP_PANEL, metavar="HOST:PORT",
        help="Where rank 0 takes the followers' passes (default: PIE_PASS_ADDRESS, or the coordinator's port + 1).")
    ] = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat and text completions, streaming, metrics)."""
    missing = [name for name in SERVE_LIBRARIES if importlib.util.find_spec(name) is None]
    if missing:
        raise fail(f"{SERVE_EXTRA_HINT} (missing: {', '.join(missing)})")
    for name, value, low in (("--max-running", max_running, 1), ("--max-waiting", max_waiting, 0),
                             ("--max-body-bytes", max_body_bytes, 1), ("--port", port, 0),
                             ("--inferlet-workers", inferlet_workers, 1), ("--max-inferlet-runs", max_inferlet_runs, 1),
                             ("--runs-per-worker", 1 if runs_per_worker is None else runs_per_worker, 1),
                             ("--inferlet-token-budget", inferlet_token_budget, 1)):
        if value < low:
            raise usage(f"{name} must be at least {low}, not {value}")
    if port > 65535:
        raise usage(f"--port must be at most 65535, not {port}")
    if not host.strip():  # the socket would take it as every address, and warnings would name no address
        raise usage("--host is empty: give an address (127.0.0.1 for this machine only, 0.0.0.0 for every interface)")
    if not drain_seconds >= 0:
        raise usage(f"--drain-seconds must be a number of seconds >= 0, not {drain_seconds}")
    if kv_tokens is not None and kv_tokens < 1:
        raise usage(f"--kv-tokens must be at least 1, not {kv_tokens}")
    if host_kv_tokens < 0:
        raise usage(f"--host-kv-tokens must be at least 0, not {host_kv_tokens}")
    if not 0 < kv_memory_share < 1:
        raise usage(f"--kv-memory-share must be between 0 and 1, not {kv_memory_share}")
    if stall_seconds is not None and not (math.isfinite(stall_seconds) and stall_seconds > 0):
        raise usage(f"--stall-seconds must be a finite number of seconds above 0, not {stall_seconds}")
    if not (math.isfinite(inferlet_seconds) and inferlet_seconds > 0):
        raise usage(f"--inferlet-seconds must be a finite number of seconds above 0, not {inferlet_seconds}")
    origins = tuple(allowed_origin or ())
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s?#]+", origin):
            raise usage(f"--allowed-origin {origin!r} is no origin: give a scheme and a host (and a port where it is "
                       "not the default), as http://localhost:3000, with no path")
    api_key = _api_key(api_key_file)
    if "*" in origins and api_key is None:
        raise usage(f"--allowed-origin '*' needs an API key (--api-key-file or {API_KEY_ENV}): without one, any web page "
                   "a browser on this machine opens could use the server")
    if inferlets is not None and not inferlets.is_dir():
        raise fail(f"--inferlets {inferlets}: not a folder")
    if ray is None and (replicas is not None or replica_resource or replica_pin_cores):
        raise usage("--replicas, --replica-resource and --replica-pin-cores need --ray")
    if ray is not None:
        lacking = _ray_extra_lacks()
        if lacking:
            from pie.serve import RAY_EXTRA_HINT

            raise fail(f"{RAY_EXTRA_HINT} ({'; '.join(lacking)})")
        if inferlets is not None or allow_uploads:
            raise usage("--ray does not route inferlet runs yet: serve inferlets from one `pie serve`")
        if replicas is not None and replicas < 1:
            raise usage(f"--replicas must be at least 1, not {replicas}")
        _check_ray_address(ray)
    group_options = (coordinator, num_processes, process_id, pass_address)
    process_group = process_group or any(option is not None for option in group_options)
    if process_group and (ray is not None or engine is None):
        raise usage("--process-group needs --engine (the engine whose processes form the group) and no --ray")
    from pie.inferlet.workers import RunLimits
    from pie.serve.app import ServeSettings
    from pie.serve.server import run_server

    settings = ServeSettings(
        model=model,
        engine=engine,
        served_model_name=served_model_name,
        api_key=api_key,
        open_probes=not protect_probes,
        max_running=max_running,
        max_waiting=max_waiting,
        max_body_bytes=max_body_bytes,
        kv_tokens=kv_tokens,
        kv_memory_share=kv_memory_share,
        kv_dtype=kv_dtype,
        host_kv_tokens=host_kv_tokens,
        dtype=dtype,
        prefix_caching=prefix_cache,
        drain_seconds=drain_seconds,
        **({} if stall_seconds is None else {"stall_seconds": stall_seconds}),
        inferlets=inferlets,
        allow_uploads=allow_uploads,
        inferlet_workers=inferlet_workers,
        **({} if runs_per_worker is None else {"runs_per_worker": runs_per_worker}),
        max_inferlet_runs=max_inferlet_runs,
        run_limits=RunLimits(token_budget=inferlet_token_budget, wall_seconds=inferlet_seconds),
        ui=ui,
        allowed_origins=origins,
    )
    try:
        if ray is not None:
            from pie.serve.ray import ReplicaResources, serve_ray

            resources = ReplicaResources(replica_cpus, replica_gpus, _resources(replica_resource or []),
                                         replica_pin_cores)
            code = serve_ray(settings, host, port, address=ray, replicas=replicas, resources=resources,
                             access_log=access_log)
        elif process_group:
            assert engine is not None  # checked above
            code = _serve_in_group(settings, engine, host, port, access_log, group_options)
        else:
            code = run_server(settings, host, port, access_log=access_log)
    except OSError as exc:  # the address is taken, or not ours to bind
        raise fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    raise typer.Exit(code)


def _ray_extra_lacks() -> list[str]:
    """What this environment lacks of the ray extra: each library missing, and an aiohttp older than the ingress
    needs (a ray installed on its own may come with one)."""
    lacking = [f"{name} is not installed" for name in RAY_LIBRARIES if importlib.util.find_spec(name) is None]
    if importlib.util.find_spec("aiohttp") is not None:
        try:
            version = importlib.metadata.version("aiohttp")
        except importlib.metadata.PackageNotFoundError:  # importable without its metadata: nothing to compare
            return lacking
        if tuple(int(part) for part in re.findall(r"\d+", version)[:2]) < LEAST_AIOHTTP:
            lacking.append(f"aiohttp {version} is older than {'.'.join(map(str, LEAST_AIOHTTP))}")
    return lacking


def _serve_in_group(
    settings: ServeSettings, engine_name: str, host: str, port: int, access_log: bool,
    group_options: tuple[str | None, int | None, int | None, str | None],
) -> int:
    """Join engine ``engine_name``'s process group, then serve and lead on rank 0, or follow rank 0 elsewhere.

    Every rank loads the model alike (the same runner, pool and programs, in the same order). A follower
    that loses its leader exits 1 without leaving the group (whose coordinator may be gone with it).
    """
    from pie.plugins import EngineError, EngineRegistry
    from pie.runtime.replicated import PASS_ADDRESS_ENV, Leader, follow
    from pie.runtime.replicated import pass_address as resolve_pass_address
    from pie.serve.server import _load, listen, run_server, say

    coordinator, num_processes, process_id, pass_address = group_options
    try:
        engine = EngineRegistry().loaded(engine_name)
        group = engine.join_process_group(coordinator, num_processes, process_id)
        address = resolve_pass_address(group, pass_address) if group.num_processes > 1 else None
    except (EngineError, ValueError) as exc:
        raise fail(str(exc)) from None
    if address is None:
        return run_server(settings, host, port, access_log=access_log)
    if not group.leads:
        try:
            runner = _load(settings).runner
        except (EngineError, OSError, ValueError) as exc:  # rank 0's serve says it as "cannot serve: ..."
            raise fail(f"process {group.process_id} cannot follow: {exc}") from None
        try:
            ran = follow(runner, group, address)
        except ConnectionError as exc:
            say(f"process {group.process_id}: {exc}")
            return 1
        say(f"process {group.process_id}: the leader closed after {ran} operation(s)")
        runner.close()
        engine.leave_process_group()
        return 0
    try:  # before the model loads (minutes, on every process): a taken address fails at once
        listener = listen(*address)
    except OSError as exc:
        given = (f"--pass-address {pass_address}" if pass_address else
                 f"{PASS_ADDRESS_ENV}={os.environ[PASS_ADDRESS_ENV]}" if os.environ.get(PASS_ADDRESS_ENV) else
                 "the coordinator's port + 1, as no --pass-address was given")
        raise fail(f"process 0 cannot listen for the followers' pass channels on {address[0]}:{address[1]} "
                   f"({given}): {exc.strerror or exc}; give a free port") from None
    leaders: list[Leader] = []

    def load_and_lead(settings: ServeSettings) -> LLM:
        llm = _load(settings)
        leaders.append(Leader(llm.runner, group, listener))
        return llm

    try:
        code = run_server(settings, host, port, access_log=access_log, load=load_and_lead)
    finally:
        listener.close()  # (the leader's, once it took the followers: closed already)
        for leader in leaders:
            leader.close()
    engine.leave_process_group()
    return code


def _resources(given: list[str]) -> tuple[tuple[str, float], ...]:
    found = []
    for item in given:
        name, _, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            raise usage(f"--replica-resource {item!r}: give NAME=AMOUNT, e.g. TPU=4") from None
        if not name or not value > 0:
            raise usage(f"--replica-resource {item!r}: give NAME=AMOUNT with an amount above 0")
        found.append((name, value))
    return tuple(found)


RAY_CONNECT_SECONDS = 5.0


def _check_ray_address(address: str) -> None:
    """A cluster's address must answer before Ray is asked to join it: Ray retries one that does not for
    minutes, printing its own connection warnings."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise usage(f"--ray {address}: expected auto, local or a cluster's HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_SECONDS).close()
    except OSError as exc:
        raise fail(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc})") from None


MAX_KEY_FILE_BYTES = 4096
"""The largest --api-key-file read."""


def _api_key(path: Path | None) -> str | None:
    """The key from --api-key-file (it wins) or PIE_API_KEY; None when neither is given."""
    if path is not None:
        try:  # a regular file of bounded size: /dev/zero was read until memory ran out, a FIFO waited for ever
            key = read_regular_file(path, MAX_KEY_FILE_BYTES).decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = f"it is not UTF-8 text (byte {exc.start})" if isinstance(exc, UnicodeDecodeError) else exc.strerror
            raise fail(f"--api-key-file {path}: cannot read it ({why or exc})") from None
        if not key:
            raise fail(f"--api-key-file {path} is empty")
        return _header_safe(key, f"--api-key-file {path}")
    key = os.environ.get(API_KEY_ENV, "").strip()
    return _header_safe(key, API_KEY_ENV) if key else None


def _header_safe(key: str, source: str) -> str:
    """``key``, where an HTTP header can carry it (printable ASCII only); else exit 1 naming ``source``."""
    if not key.isprintable() or not key.isascii():
        raise fail(f"{source} holds characters other than printable ASCII (a key is sent in an HTTP header, which "
                   "cannot carry them)")
    return key


