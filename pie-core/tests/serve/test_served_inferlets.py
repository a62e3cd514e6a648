"""Inferlets over HTTP: listed, run in worker processes and streamed, cancelled; results equal to in-process runs."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from pie.serve import inferlets
from pie.serve.app import ServerState, ServeSettings, create_app
from pie.serve.inferlets import _sse, installed_inferlets
from pie.testing.serve_process import PIE, ServeProcess, wait_until
from starlette.testclient import TestClient

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
ARGS = {
    "best_of_n": ["The quick brown fox", "--n", "3", "--max-tokens", "5", "--temperature", "1.0", "--seed", "4"],
    "constrained_choice": ["Is the sky blue? Answer:", "--option", " yes", "--option", " no"],
}


def run_events(client: openai.OpenAI, name: str, args: list[str]) -> list[dict[str, Any]]:
    stream = client.post(f"/inferlets/{name}/runs", body={"args": args}, cast_to=object, stream=True,
                         stream_cls=openai.Stream[object])
    return list(stream)


@pytest.fixture(scope="module")
def inferlet_server(tiny_model: Path) -> ServeProcess:
    with ServeProcess("--model", str(tiny_model), "--served-model-name", "tiny", "--inferlets", str(EXAMPLES),
                      "--kv-tokens", "4096") as server:
        server.wait_ready()
        yield server
        assert server.stop() == 0, server.log


@pytest.fixture
def api(inferlet_server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{inferlet_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_installed_inferlets_are_listed_with_their_descriptions(api: openai.OpenAI) -> None:
    listing = api.get("/inferlets", cast_to=object)
    names = {entry["name"]: entry["description"] for entry in listing["data"]}
    assert set(names) == {"beam_search", "best_of_n", "constrained_choice", "two_agents"}
    assert names["best_of_n"].startswith("Best-of-n") and listing["uploads"] is False


@pytest.mark.parametrize("name", sorted(ARGS))
def test_a_served_run_gives_what_pie_run_gives(api: openai.OpenAI, tiny_model: Path, name: str) -> None:
    events = run_events(api, name, ARGS[name])
    assert events[0]["type"] == "run" and events[0]["id"].startswith("run-")
    assert events[-1]["type"] == "result"
    local = subprocess.run([PIE, "run", "--model", str(tiny_model), "--engine", "cpu", "--inferlet",
                            str(EXAMPLES / f"{name}.py"), "--", *ARGS[name]], capture_output=True, text=True, timeout=120)
    assert local.returncode == 0, local.stderr
    expected = json.loads(local.stdout)
    served = events[-1]["value"]
    if name == "best_of_n":
        assert [c["tokens"] for c in served["candidates"]] == [c["tokens"] for c in expected["candidates"]]
        assert served["best"] == expected["best"] and served["prompt_page_refcounts"] == expected["prompt_page_refcounts"]
    else:
        assert served["choice"] == expected["choice"] and served["prompt_tokens"] == expected["prompt_tokens"]
        assert served["tokens"] == expected["tokens"]


def test_an_event_the_stream_carries_is_strict_json() -> None:
    """Infinity is no JSON (a browser's JSON.parse fails on it): an event holding one is never written."""
    assert _sse({"type": "emit", "value": [1.5]}) == b'data: {"type": "emit", "value": [1.5]}\n\n'
    with pytest.raises(ValueError, match="not JSON compliant"):
        _sse({"type": "emit", "value": [float("inf")]})


def test_an_unknown_inferlet_is_a_404_and_uploads_are_refused(api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="no inferlet named 'nope'"):
        run_events(api, "nope", [])
    with pytest.raises(openai.PermissionDeniedError, match="--allow-uploads"):
        api.post("/inferlets/runs", body={"source": "async def main(ctx, args):\n    return 1\n"}, cast_to=object)


def test_a_failing_run_ends_with_an_error_event_and_the_server_goes_on(api: openai.OpenAI,
                                                                       inferlet_server: ServeProcess) -> None:
    """The run's 500 counts in pie:request_errors_total, as a request's stream's error does (it counted nowhere)."""
    errors = "pie:request_errors_total{status=500}"
    before = inferlet_server.metrics().get(errors, 0)
    with pytest.raises(openai.APIError, match="exited with status 2"):
        run_events(api, "best_of_n", ["--no-such-flag"])
    assert wait_until(lambda: inferlet_server.metrics()["pie:kv_pages_used"] == 0)
    assert inferlet_server.metrics().get(errors, 0) == before + 1
    assert run_events(api, "constrained_choice", ARGS["constrained_choice"])[-1]["type"] == "result"


FOREVER = '''"""Generates and emits until it is stopped."""


async def main(ctx, args):
    rounds = 0
    while True:
        context = ctx.context("Forever and ever")
        for _ in range(10):
            await context.step()
        context.drop()
        rounds += 1
        ctx.emit({"round": rounds})
'''

BURNER = '''"""Forwards 200 tokens a pass until its budget runs out."""


async def main(ctx, args):
    context = ctx.context("Burn")
    while True:
        context.fill(tokens=[5] * 200)
        await context.flush()
        context.drop()
        context = ctx.context("Burn")
'''


COUNTED = '''"""Fills a prompt, then forwards six tokens it picks, one pass each; returns the prompt's length."""


async def main(ctx, args):
    context = ctx.context("Count the tokens of this run")
    for _ in range(6):
        await context.step()
    await context.flush()
    return len(context.tokens) - 6
'''


@pytest.fixture(scope="module")
def limited_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    folder = tmp_path_factory.mktemp("inferlets")
    (folder / "forever.py").write_text(FOREVER)
    (folder / "burner.py").write_text(BURNER)
    (folder / "counted.py").write_text(COUNTED)
    with ServeProcess("--model", str(tiny_model), "--inferlets", str(folder), "--kv-tokens", "4096",
                      "--inferlet-token-budget", "20000", "--inferlet-seconds", "3") as server:
        server.wait_ready()
        yield server
        assert server.stop() == 0, server.log


def idle(server: ServeProcess) -> bool:
    sample = server.metrics()
    return sample["pie:kv_pages_used"] == 0 and sample["pie:inferlet_runs"] == 0


def start_forever(server: ServeProcess) -> tuple[openai.OpenAI, Iterator[Any], dict[str, Any]]:
    """A run of the inferlet that never ends, once it has emitted: the client, the run's events and its first one."""
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = api.post("/inferlets/forever/runs", body={}, cast_to=object, stream=True, stream_cls=openai.Stream[object])
    events = iter(stream)
    run = next(events)
    assert next(events)["type"] == "emit"
    return api, events, run


def test_delete_cancels_a_run_and_its_pages_come_back(limited_server: ServeProcess) -> None:
    api, events, run = start_forever(limited_server)
    assert api.delete(f"/runs/{run['id']}", cast_to=object)["cancelled"] is True
    with pytest.raises(openai.APIError, match="cancelled"):
        for _ in events:
            pass
    assert wait_until(lambda: idle(limited_server)), limited_server.metrics()
    with pytest.raises(openai.NotFoundError):
        api.delete(f"/runs/{run['id']}", cast_to=object)


def test_a_run_cannot_be_cancelled_by_a_client_that_guesses_its_id(limited_server: ServeProcess) -> None:
    """Run ids were run-1, run-2, ...: a client could cancel everyone else's runs by counting."""
    api, events, run = start_forever(limited_server)
    for guess in range(1, 33):
        with pytest.raises(openai.NotFoundError):
            api.delete(f"/runs/run-{guess}", cast_to=object)
    assert next(events)["type"] == "emit"
    assert api.delete(f"/runs/{run['id']}", cast_to=object)["cancelled"] is True
    with pytest.raises(openai.APIError, match="cancelled"):
        for _ in events:
            pass
    assert wait_until(lambda: idle(limited_server)), limited_server.metrics()


def test_the_wall_clock_limit_and_the_token_budget_stop_a_run(limited_server: ServeProcess) -> None:
    api = openai.OpenAI(base_url=f"{limited_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError, match="did not finish within 3 s"):
        run_events(api, "forever", [])
    with pytest.raises(openai.APIError, match="budget of 20000 tokens"):
        run_events(api, "burner", [])
    assert wait_until(lambda: idle(limited_server)), limited_server.metrics()


def test_a_client_that_leaves_ends_its_run(limited_server: ServeProcess) -> None:
    api = openai.OpenAI(base_url=f"{limited_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = api.post("/inferlets/forever/runs", body={}, cast_to=object, stream=True, stream_cls=openai.Stream[object])
    events = iter(stream)
    next(events)
    next(events)
    stream.close()
    assert wait_until(lambda: idle(limited_server)), limited_server.metrics()


def test_a_runs_tokens_count_in_the_status_and_metrics_totals(limited_server: ServeProcess) -> None:
    """As vLLM's totals count all the work its engine did: a run's prompt and decode steps, not requests' alone."""
    api = openai.OpenAI(base_url=f"{limited_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    before, metrics_before = api.get("/pie/status", cast_to=object)["tokens"], limited_server.metrics()
    prompt_tokens = run_events(api, "counted", [])[-1]["value"]
    after, metrics_after = api.get("/pie/status", cast_to=object)["tokens"], limited_server.metrics()
    assert prompt_tokens > 1
    assert (after["prompt"] - before["prompt"], after["generation"] - before["generation"]) == (prompt_tokens, 6)
    for name, counted in (("pie:prompt_tokens_total", prompt_tokens), ("pie:generation_tokens_total", 6)):
        assert metrics_after[name] - metrics_before[name] == counted, name


MAIN = "async def main(ctx, args):\n    return 1\n"
TOO_DEEP = ("x = " + "-" * 200_000 + "1\n", "x = a" + ".b" * 300_000 + "\n")
"""Python that CPython cannot parse: its parser's stack overflows (MemoryError), its tree's construction recurses
too deeply (RecursionError). Both were a 500 "internal error", and stopped `pie serve --inferlets` at start."""


def test_uploaded_source_runs_sandboxed_only_with_allow_uploads(tiny_model: Path) -> None:
    with ServeProcess("--model", str(tiny_model), "--allow-uploads", "--kv-tokens", "4096") as server:
        server.wait_ready()
        assert "sandbox layers active" in server.log
        # Root's workers are held to no thread count (RLIMIT_NPROC), which only the README said.
        assert ("warning: uploads run as root" in server.log) == (os.geteuid() == 0), server.log
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert api.get("/inferlets", cast_to=object)["uploads"] is True
        source = ("async def main(ctx, args):\n    c = ctx.context(args[0])\n"
                  "    return {'tokens': await c.generate_tokens(3), 'cwd': __import__('os').listdir('.')}\n")
        events = list(api.post("/inferlets/runs", body={"source": source, "args": ["hello"], "name": "mine"},
                               cast_to=object, stream=True, stream_cls=openai.Stream[object]))
        result = events[-1]["value"]
        assert events[-1]["type"] == "result" and len(result["tokens"]) == 3
        assert result["cwd"] == ["mine.py"], "a folder of its own, holding its source"
        with pytest.raises(openai.APIError, match="PermissionError"):
            list(api.post("/inferlets/runs", body={"source": "async def main(ctx, args):\n    open('/etc/hostname')\n"},
                          cast_to=object, stream=True, stream_cls=openai.Stream[object]))
        with pytest.raises(openai.BadRequestError, match="name"):
            api.post("/inferlets/runs", body={"source": "x", "name": "../evil"}, cast_to=object)
        for bad, says in (("def main(:\n", r"source: cannot be read as Python: invalid syntax \(line 1\)"),
                          ("def main(ctx, args):\n    return 1\n", r"source: defines no `async def main\(ctx, args\)`"),
                          *((MAIN + deep, "source: cannot be read as Python: too deeply nested to parse")
                            for deep in TOO_DEEP)):
            with pytest.raises(openai.BadRequestError, match=says) as refused:
                api.post("/inferlets/runs", body={"source": bad}, cast_to=object)
            assert refused.value.param == "source"
        with pytest.raises(openai.BadRequestError, match="argz: not a field this server knows"):
            api.post("/inferlets/runs", body={"source": source, "argz": ["hello"]}, cast_to=object)
        assert server.stop() == 0, server.log
        assert "Traceback" not in server.log


SECRET_HOLDER = "import asyncio\n\nSECRET = 'my-private-prompt-4242'\n\n\nasync def main(ctx, args):\n" \
    "    await asyncio.sleep(4)\n    return SECRET\n"
SNOOP = """import glob, os


async def main(ctx, args):
    found = {}
    beside = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the uploads' folders were
    for pattern in (beside + '/*/*.py', '../*/*.py', '/tmp/*/*.py', '/tmp/*/*/*.py'):
        for path in glob.glob(pattern):
            try:
                found[path] = open(path).read()
            except OSError as exc:
                found[path] = type(exc).__name__
    return found
"""


def test_an_upload_cannot_read_another_upload_running_beside_it(tiny_model: Path) -> None:
    with ServeProcess("--model", str(tiny_model), "--allow-uploads", "--kv-tokens", "4096") as server:
        server.wait_ready()
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def run(source: str, name: str) -> object:
            events = list(api.post("/inferlets/runs", body={"source": source, "name": name}, cast_to=object,
                                   stream=True, stream_cls=openai.Stream[object]))
            return events[-1]["value"]

        holder = ThreadPoolExecutor(1).submit(run, SECRET_HOLDER, "holder")
        assert wait_until(lambda: server.metrics().get("pie:inferlet_runs", 0) >= 1), server.metrics()
        snooped = run(SNOOP, "snoop")
        assert holder.result(timeout=60) == "my-private-prompt-4242", "the holder ran beside the snoop"
        assert "my-private-prompt-4242" not in str(snooped), snooped
        assert server.stop() == 0, server.log


PID = "import os\n\n\nasync def main(ctx, args):\n    return os.getpid()\n"


def test_an_installed_inferlets_runs_share_a_warm_worker_and_uploads_never_do(
    tiny_model: Path, tmp_path: Path
) -> None:
    (tmp_path / "pid.py").write_text('"""Its process id."""\n' + PID)
    with ServeProcess("--model", str(tiny_model), "--inferlets", str(tmp_path), "--allow-uploads",
                      "--kv-tokens", "4096") as server:
        server.wait_ready()
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        installed = [run_events(api, "pid", [])[-1]["value"] for _ in range(3)]
        uploaded = [list(api.post("/inferlets/runs", body={"source": PID, "name": "pid"}, cast_to=object,
                                  stream=True, stream_cls=openai.Stream[object]))[-1]["value"] for _ in range(2)]
        assert len(set(installed)) == 1, installed
        assert len({*uploaded, installed[0]}) == 3, (installed, uploaded)
        assert server.stop() == 0, server.log


def test_runs_per_worker_1_gives_every_run_a_new_worker(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "pid.py").write_text('"""Its process id."""\n' + PID)
    with ServeProcess("--model", str(tiny_model), "--inferlets", str(tmp_path), "--runs-per-worker", "1",
                      "--kv-tokens", "4096") as server:
        server.wait_ready()
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        pids = [run_events(api, "pid", [])[-1]["value"] for _ in range(3)]
        assert len(set(pids)) == 3, pids
        assert server.stop() == 0, server.log


def test_the_inferlets_folder_says_what_it_leaves_out_and_why(tmp_path: Path) -> None:
    """A file and a package of one name, and names no URL can carry, were dropped without a word; a file nested too
    deeply to parse stopped the server at start."""
    (tmp_path / "foo").mkdir()
    (tmp_path / "foo" / "__init__.py").write_text(PID)
    (tmp_path / "foo.py").write_text(PID)
    (tmp_path / "Bad.Name.py").write_text(PID)
    (tmp_path / "deep.py").write_text(MAIN + TOO_DEEP[0])
    (tmp_path / "_helper.py").write_text("HELP = 1\n")
    (tmp_path / "good.py").write_text('"""Its process id."""\n' + PID)
    found, skipped = installed_inferlets(tmp_path)
    assert list(found) == ["good"] and found["good"].description == "Its process id."
    assert sorted(skipped) == sorted([
        f"{tmp_path / 'Bad.Name.py'}: 'Bad.Name' is not a name a URL can carry (an inferlet's name is a letter, "
        "then letters, digits, '_' or '-' (64 at most))",
        f"{tmp_path / 'deep.py'}: cannot be read as Python: too deeply nested to parse",
        f"{tmp_path / 'foo'}/ and {tmp_path / 'foo.py'}: both are named 'foo', so neither is served (rename one)",
    ])


def uploading_app() -> FastAPI:
    """A server without a model that takes uploads: a source it finds to be an inferlet gets 503 "loading"."""
    return create_app(ServerState(ServeSettings(served_model_name="tiny", allow_uploads=True)))


def test_an_upload_is_read_in_a_child_process_not_in_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """ast.parse of a megabyte of source holds the GIL for seconds: read on the event loop, one upload stalled
    /health, every stream and all admission for 5 s."""
    read_here: list[str] = []
    monkeypatch.setattr(inferlets, "inferlet_tree", lambda source, filename: read_here.append(filename))
    with TestClient(uploading_app()) as client:
        refused = client.post("/v1/inferlets/runs", json={"source": "def main(:\n", "name": "mine"})
        taken = client.post("/v1/inferlets/runs", json={"source": MAIN, "name": "mine"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "source"
    assert "invalid syntax (line 1)" in refused.json()["error"]["message"]
    assert taken.status_code == 503 and "loading" in taken.json()["error"]["message"]
    assert read_here == []


def test_an_upload_that_takes_too_long_to_read_is_a_400_and_its_reader_is_killed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pid_file = tmp_path / "reader.pid"
    hangs = f"import os, threading\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\nthreading.Event().wait()\n"
    monkeypatch.setattr(inferlets, "CHECK_SCRIPT", hangs)
    monkeypatch.setattr(inferlets, "PARSE_SECONDS", 5.0)
    with TestClient(uploading_app()) as client:
        refused = client.post("/v1/inferlets/runs", json={"source": MAIN})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "source"
    assert refused.json()["error"]["message"] == "source: took too long to parse (over 5 s)"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
