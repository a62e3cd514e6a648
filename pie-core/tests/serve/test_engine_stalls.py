"""An engine step that does not return (a kernel or the device hangs) stalls the server: /health answers 503, new
requests are refused with code engine_stalled, /metrics says so, the log says so once; the requests in flight wait
for the step. Once it returns, the server serves again by itself.

The step is made to hang deterministically: the model's first kernel launch waits on an event the test sets."""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.main import get_command
from typer.testing import CliRunner

from pie.cli import app
from pie.plugins import DeviceLost
from pie.runtime.llm import LLM
from pie.serve.app import ServerState, ServeSettings
from pie.serve.engine import STALL_SECONDS
from pie.testing.serve_process import in_process, wait_until

STALL_S = 0.5
HELD_S = 60.0
"""Longest a held launch waits for the test to let it go: a failing test does not hang the run."""


class HeldLaunch:
    """The model's first kernel launch, held while ``held`` until ``let_go``."""

    def __init__(self, llm: LLM):
        plan = llm.runner.plan
        program = list(plan._program)
        launcher, inputs, output, name = program[0]
        self.held = threading.Event()
        self.entered = threading.Event()
        self._gone = threading.Event()

        def launch(*args: object) -> object:
            if self.held.is_set():
                self.entered.set()
                self._gone.wait(HELD_S)
            return launcher(*args)

        program[0] = (launch, inputs, output, name)
        plan._program = tuple(program)

    def let_go(self) -> None:
        self.held.clear()
        self._gone.set()


def _health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == "pie.serve" and record.levelno == logging.WARNING]


def test_a_step_that_hangs_stalls_the_server_until_it_returns(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hung step left /health at 200 and queued every new request behind it, for ever: a load balancer, Kubernetes
    and the Ray ingress kept sending it traffic."""
    caplog.set_level(logging.WARNING, logger="pie.serve")
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    launch = HeldLaunch(llm)
    state = ServerState(ServeSettings(served_model_name="tiny", stall_seconds=STALL_S), llm)
    with in_process(state) as url, ThreadPoolExecutor(1) as pool:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert _health(url).status_code == 200 and _metrics(url)["pie:engine_stalled"] == 0
        launch.held.set()
        in_flight = pool.submit(client.completions.create, model="tiny", prompt=[5, 7, 9], max_tokens=4,
                                extra_body={"ignore_eos": True})
        assert launch.entered.wait(30)
        assert wait_until(lambda: _health(url).status_code == 503, timeout=30), _health(url).text
        health = _health(url).json()
        assert health["status"] == "stalled" and state.phase == "stalled"  # (what a Ray replica's actor reports)
        assert re.fullmatch(r"the engine's step has run for \d+\.\d s \(bound --stall-seconds 0\.5\): a kernel or the "
                            r"device hangs; new requests are refused until it returns", health["error"]), health
        status = httpx.get(f"{url}/v1/pie/status", timeout=10).json()  # (what the web page shows)
        assert status["phase"] == "stalled" and "the engine's step has run for" in status["error"], status
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError, match="the engine's step has run for") as refused:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, stream=stream)
            assert refused.value.status_code == 503 and refused.value.body["code"] == "engine_stalled"
            assert refused.value.response.headers["retry-after"] == "5"
        metrics = _metrics(url)
        assert metrics["pie:engine_stalled"] == 1 and metrics["pie:engine_step_age_seconds"] > STALL_S
        assert metrics["pie:requests_running"] == 1, "the refused requests never reached the engine"
        assert wait_until(lambda: any("engine's step has run for" in line for line in _warnings(caplog)))
        assert not in_flight.done()

        launch.let_go()
        assert in_flight.result(timeout=60).usage.completion_tokens == 4, "the request in flight ends as ever"
        assert wait_until(lambda: _health(url).status_code == 200, timeout=30), _health(url).text
        assert _health(url).json() == {"status": "ready"}
        assert _metrics(url)["pie:engine_stalled"] == 0
        assert client.completions.create(model="tiny", prompt=[5, 7, 9], max_tokens=4,
                                        extra_body={"ignore_eos": True}).usage.completion_tokens == 4
        assert wait_until(lambda: any("stalled step returned" in line for line in _warnings(caplog)))
    said = _warnings(caplog)
    assert [line for line in said if "engine's step has run for" in line] == [said[0]], "said once as it began"
    assert re.fullmatch(r"pie serve: the engine's stalled step returned, about \d+ s after it began; serving again",
                        said[1]), said
    assert len(said) == 2, said


def test_a_device_lost_while_a_step_stalls_fails_the_server(tiny_model: Path) -> None:
    """A driver that gives up on a hung kernel may lose the device as the step ends: the server is failed from then
    on (the stall is no phase of its own under it), not ready again once the step returns."""
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    launch = HeldLaunch(llm)
    state = ServerState(ServeSettings(served_model_name="tiny", stall_seconds=STALL_S), llm)
    with in_process(state) as url, ThreadPoolExecutor(1) as pool:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        launch.held.set()
        in_flight = pool.submit(client.completions.create, model="tiny", prompt=[5, 7, 9], max_tokens=4)
        assert launch.entered.wait(30)
        assert wait_until(lambda: state.phase == "stalled", timeout=30)
        state.lose_device(DeviceLost("the driver reset the device"))
        assert _health(url).json()["status"] == "failed"
        launch.let_go()
        in_flight.result(timeout=60)
        health = _health(url)
        assert health.status_code == 503 and health.json()["status"] == "failed", health.text
        assert "the driver reset the device" in health.json()["error"]


@pytest.mark.parametrize("given", ["0", "-1", "nan", "inf"])
def test_a_stall_bound_that_is_no_positive_finite_number_is_refused(given: str) -> None:
    result = CliRunner().invoke(app, ["serve", "--stall-seconds", given])
    assert result.exit_code == 2, result.output
    assert f"--stall-seconds must be a finite number of seconds above 0, not {float(given)}" in result.output


def test_the_stall_bound_reaches_the_server_and_its_help_names_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[ServeSettings] = []

    def run_server(settings: ServeSettings, *args: Any, **kwargs: Any) -> int:
        served.append(settings)
        return 0

    monkeypatch.setattr("pie.serve.server.run_server", run_server)
    for args, bound in ((["--stall-seconds", "2.5"], 2.5), ([], STALL_SECONDS)):
        result = CliRunner().invoke(app, ["serve", *args])
        assert result.exit_code == 0, result.output
        assert served.pop().stall_seconds == bound
    (option,) = (p for p in get_command(app).commands["serve"].params if p.name == "stall_seconds")
    assert f"Default: {STALL_SECONDS:g}." in option.help
