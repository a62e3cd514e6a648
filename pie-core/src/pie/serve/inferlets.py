"""The inferlet endpoints of `pie serve`: the installed inferlets, runs streamed as SSE, cancellation.

``GET /v1/inferlets`` lists what the operator installed (``--inferlets DIR``: one file or
package each, described by its docstring, read without running it). ``POST
/v1/inferlets/{name}/runs`` runs one in a worker process and streams its events:
``{"type": "run", "id": ...}`` first, then ``{"type": "emit", "value": ...}`` for
each value it emits, then ``{"type": "result", "value": ...}`` and ``[DONE]``, or an
``{"error": {...}}`` event (which the official client raises). ``POST
/v1/inferlets/runs`` runs uploaded source (only with ``--allow-uploads``), and
``DELETE /v1/runs/{id}`` cancels a run.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import re
import secrets
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.sse import KEEPALIVE_COMMENT
from pydantic import Field

from pie.inferlet.workers import RunLimits, RunOutcome
from pie.serve.engine import Emitted, Engine, Event, Failed, RunEnded, RunRequest, RunTokens
from pie.serve.failures import engine_error, internal_error
from pie.serve.inferlet_source import inferlet_tree
from pie.serve.protocol import APIError, KnownFields
from pie.serve.streams import ReleasingStream

log = logging.getLogger("pie.serve")

NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
NAME_RULE = "a letter, then letters, digits, '_' or '-' (64 at most)"
MAX_SOURCE_CHARS = 1 << 20
"""An upload's source, in characters (a 400 past it, naming `source`)."""
CHECK_SCRIPT = resources.files("pie.serve").joinpath("inferlet_source.py").read_text()
"""What the child that checks an upload runs: :mod:`pie.serve.inferlet_source`, whose ``__main__`` part answers."""
PARSE_SECONDS = 10.0
PARSE_MEMORY_BYTES = 2 << 30
"""The address space the child that checks an upload may map: the largest source MAX_SOURCE_CHARS lets through
(half a million lines of one name each) takes nearly 1 GiB to parse."""
PARSES_AT_ONCE = 2
KEEPALIVE_S = 15.0


@dataclass(frozen=True)
class InstalledInferlet:
    name: str
    description: str
    path: Path
    """The file, or the package folder, the worker imports."""


def installed_inferlets(directory: Path) -> tuple[dict[str, InstalledInferlet], list[str]]:
    """The inferlets in ``directory`` by name, and a line for each entry left out (and why).

    An entry is a ``.py`` file or a package folder; one whose name starts with ``_`` (``__init__.py``,
    ``__pycache__``, a helper module) is no inferlet, and is passed over without a word."""
    by_name: dict[str, list[Path]] = {}
    skipped: list[str] = []
    for entry in sorted(directory.iterdir()):
        if entry.is_file() and entry.suffix == ".py":
            name = entry.stem
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            name = entry.name
        else:
            continue
        if name.startswith("_"):
            continue
        if NAME.fullmatch(name):
            by_name.setdefault(name, []).append(entry)
        else:
            skipped.append(f"{entry}: {name!r} is not a name a URL can carry (an inferlet's name is {NAME_RULE})")
    found: dict[str, InstalledInferlet] = {}
    for name, entries in by_name.items():
        if len(entries) > 1:  # foo/ and foo.py
            both = " and ".join(f"{entry}/" if entry.is_dir() else str(entry) for entry in entries)
            skipped.append(f"{both}: both are named {name!r}, so neither is served (rename one)")
            continue
        entry = entries[0]
        source = entry / "__init__.py" if entry.is_dir() else entry
        try:
            tree = inferlet_tree(source.read_bytes(), str(source))
        except OSError as exc:
            skipped.append(f"{entry}: cannot be read ({exc})")
            continue
        except ValueError as exc:
            skipped.append(f"{entry}: {exc}")
            continue
        docstring = ast.get_docstring(tree) or ""
        found[name] = InstalledInferlet(name, docstring.strip().splitlines()[0] if docstring.strip() else "", entry)
    return found, skipped


async def check_upload(source: str, filename: str, parses: asyncio.Semaphore) -> None:
    """A 400 (param ``source``) where an uploaded source is no inferlet, as :func:`inferlet_tree` says, read in a
    child process (see :mod:`pie.serve.inferlet_source`) that may map PARSE_MEMORY_BYTES and is killed after
    PARSE_SECONDS; ``parses`` bounds how many run at once."""
    async with parses:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", CHECK_SCRIPT, filename, str(PARSE_MEMORY_BYTES),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(child.communicate(source.encode()), PARSE_SECONDS)
        except TimeoutError:
            raise APIError(400, f"source: took too long to parse (over {PARSE_SECONDS:g} s)", param="source") from None
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
    try:
        problem = json.loads(out)["problem"]
    except (ValueError, KeyError, TypeError):
        said = err.decode(errors="replace").strip().splitlines()
        raise APIError(500, f"the check of the uploaded source ended with status {child.returncode} and no answer"
                            + (f": {said[-1]}" if said else "")) from None
    if problem is not None:
        raise APIError(400, f"source: {problem}", param="source")


class RunBody(KnownFields):
    args: list[str] = Field(default_factory=list, max_length=256)


class UploadBody(RunBody):
    source: str = Field(max_length=MAX_SOURCE_CHARS)
    name: str = "upload"


@dataclass
class InferletService:
    """What the inferlet routes need: the installed ones, the limits, whether uploads are taken."""

    installed: dict[str, InstalledInferlet]
    limits: RunLimits
    max_runs: int
    allow_uploads: bool
    checking: int = 0
    """Uploads whose source is being checked, or waits its turn to be: each holds a place of ``max_runs`` (and its
    body, megabytes), so that what waits is bounded."""


class RunStream:
    """One run as the HTTP side sees it: the engine's events on a queue, counted in flight until it ends."""

    def __init__(self, state: Any, engine: Engine, request: RunRequest):
        self.state = state
        self.engine = engine
        self.id = f"run-{secrets.token_hex(16)}"
        """Unguessable: whoever knows it can cancel the run."""
        self.queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.handle = engine.submit_run(request, self.queue.put_nowait)
        self.ended = False
        """Its end (its result, or an error) went to its stream: a run closed before then was cancelled."""
        state.in_flight += 1
        state.active.add(self)
        state.runs[self.id] = self

    def abort(self, error: APIError) -> None:
        """End the run with ``error`` (a drain deadline; a DELETE, whose 499 counts as a cancel)."""
        if not self.handle.cancelled:
            self.engine.cancel(self.handle)
            self.queue.put_nowait([Failed(error)])

    def close(self) -> None:
        """Stop the run (its client left, if it had not ended) and count it out; safe to call twice."""
        if self not in self.state.active:
            return
        if not self.ended:
            self.state.metrics.cancelled.inc()
        self.engine.cancel(self.handle)
        self.state.active.discard(self)
        self.state.runs.pop(self.id, None)
        self.state.in_flight -= 1

    async def events(self) -> AsyncIterator[bytes]:
        try:
            yield _sse({"type": "run", "id": self.id})
            while True:
                try:
                    events = await asyncio.wait_for(self.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield KEEPALIVE_COMMENT
                    continue
                for event in events:
                    if isinstance(event, Emitted):  # its value is its JSON text (see serve_run)
                        yield _event(b'{"type": "emit", "value": ' + event.value + b"}")
                    elif isinstance(event, RunTokens):  # the totals count the work of runs too, as of requests
                        self.state.metrics.prompt_tokens.inc(event.prompt)
                        self.state.metrics.generation_tokens.inc(event.generation)
                    elif isinstance(event, RunEnded):
                        self.ended = True
                        outcome = event.outcome
                        if outcome.ok:
                            yield _sse({"type": "result", "value": outcome.value})
                            yield _event(b"[DONE]")
                        else:
                            yield self._failed(outcome)
                        return
                    elif isinstance(event, Failed):
                        self.ended = True
                        yield self._error(engine_error(event.error, self.state.lose_device))
                        return
        except Exception as exc:  # a fault of ours: the client still gets an end, not a cut connection
            log.exception("internal error in inferlet run %s", self.id)
            self.ended = True
            yield self._error(internal_error(exc))
        finally:
            self.close()

    def _failed(self, outcome: RunOutcome) -> bytes:
        """The error event of a run that ended with an error: as the engine's failure that one of its passes met (its
        kernel's 500, a 503 to retry when short of memory, a lost device's 503), where one did; else the inferlet's
        own 500. Either way ``where`` says where in the inferlet it ended."""
        if outcome.failure is not None:
            error = engine_error(outcome.failure, self.state.lose_device)
        else:
            error = APIError(500, outcome.error or "the run failed", code="inferlet_failed")
        return self._error(error, where=outcome.where)

    def _error(self, error: APIError, **fields: str) -> bytes:
        """The event that ends the run with ``error`` (and ``fields`` in its body's ``error``), counted: as a cancel
        where it is one (499), else as an error."""
        if error.status == 499:
            self.state.metrics.cancelled.inc()
        else:
            self.state.metrics.errors.labels(str(error.status)).inc()
        body = error.event_body()
        body["error"].update(fields)
        return _sse(body)


def _sse(body: dict[str, Any]) -> bytes:
    return _event(json.dumps(body, allow_nan=False).encode())


def _event(data: bytes) -> bytes:
    """A server-sent event of ``data``, one line (JSON text holds no line break), as ``format_sse_event`` writes it."""
    return b"data: " + data + b"\n\n"


def install_inferlet_routes(app: FastAPI, state: Any, service: InferletService) -> None:
    parses = asyncio.Semaphore(PARSES_AT_ONCE)

    @app.get("/v1/inferlets")
    async def list_inferlets() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"name": i.name, "description": i.description} for i in service.installed.values()],
            "uploads": service.allow_uploads,
        }

    @app.post("/v1/inferlets/runs")
    async def run_upload(body: UploadBody) -> ReleasingStream:
        if not service.allow_uploads:
            raise APIError(403, "this server runs only its installed inferlets (start it with --allow-uploads)",
                           code="uploads_disabled")
        if not NAME.fullmatch(body.name):
            raise APIError(400, f"an inferlet's name is {NAME_RULE}", param="name")
        _refuse_past_runs(state, service)
        service.checking += 1
        try:
            await check_upload(body.source, f"{body.name}.py", parses)
        finally:
            service.checking -= 1
        return _start(state, service, RunRequest(body.name, f"{body.name}.py", tuple(body.args), service.limits,
                                                 source=body.source))

    @app.post("/v1/inferlets/{name}/runs")
    async def run_installed(name: str, body: RunBody) -> ReleasingStream:
        inferlet = service.installed.get(name)
        if inferlet is None:
            raise APIError(404, f"no inferlet named {name!r} is installed here", param="name", code="inferlet_not_found")
        return _start(state, service, RunRequest(name, str(inferlet.path), tuple(body.args), service.limits))

    @app.delete("/v1/runs/{run_id}")
    async def cancel_run(run_id: str) -> dict[str, Any]:
        run = state.runs.get(run_id)
        if run is None:
            raise APIError(404, f"no run {run_id!r} is in progress", code="run_not_found")
        run.abort(APIError(499, f"the run was cancelled (DELETE /v1/runs/{run_id})", code="cancelled"))
        return {"id": run_id, "object": "run", "cancelled": True}


def _start(state: Any, service: InferletService, request: RunRequest) -> ReleasingStream:
    _, engine = state.ready()
    _refuse_past_runs(state, service)
    stream = RunStream(state, engine, request)
    return ReleasingStream(stream.events(), stream.close, media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache"})


def _refuse_past_runs(state: Any, service: InferletService) -> None:
    """A 503 when the runs in progress and the uploads being checked fill ``service.max_runs``."""
    held = len(state.runs) + service.checking
    if held >= service.max_runs:
        checked = f" ({service.checking} of them uploads being checked)" if service.checking else ""
        raise APIError(503, f"{held} inferlet runs are in progress{checked}, the most this server takes; retry later",
                       code="overloaded", headers={"Retry-After": "1"})
