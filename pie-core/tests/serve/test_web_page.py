"""`pie serve`'s web page driven in headless Chromium (Debian's, through Python playwright).

The page chats (asking for the API key on a 401), streams, stops; its runtime view follows a
background load; it says so when the server drains and when it is gone. Every wait is bounded.
Without playwright or Chromium the tests skip with the reason, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from pie.plugins import DeviceLost
from pie.runtime.llm import LLM
from pie.serve.app import ServerState, ServeSettings
from pie.serve.protocol import APIError
from pie.testing.models import make_gguf_model
from pie.testing.serve_process import ServeProcess, in_process, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",  # root, in CI
    "--disable-dev-shm-usage",  # containers often have a small /dev/shm
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WAIT_MS = 30_000
"""The longest any one wait in the page may take."""
KEY = "s3cret"
VIEWPORT = {"width": 1280, "height": 800}
CHAT = [{"role": "user", "content": "Tell me about the fox."}]
LONG = 8000
"""Tokens asked of the answers that are to be stopped or to keep the server busy: tens of seconds of work."""


def _browser_or_skip() -> Any:
    """playwright's sync API, or a skip (a failure under CI=true) saying what is missing.

    The page's Content-Security-Policy forbids eval, so the tests wait with locators and ``expect``
    (whose timeout is set to WAIT_MS), not with ``wait_for_function``."""
    try:
        from playwright import sync_api
    except ImportError:
        missing = "the playwright wheel is not installed (pip install playwright)"
    else:
        if os.path.exists(CHROMIUM):
            sync_api.expect.set_options(timeout=WAIT_MS)
            return sync_api
        missing = f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{missing}: CI must run the browser tests", pytrace=False)
    pytest.skip(missing)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = _browser_or_skip()
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=WAIT_MS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def paced_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough to generate a few hundred tokens a second here, with an 8192-token context: an answer of
    thousands of tokens is still streaming when the test presses stop."""
    path = tmp_path_factory.mktemp("web-page") / "paced.gguf"
    return make_gguf_model(path, "F32", lm_head_scale=20.0, max_position_embeddings=8192, hidden_size=512,
                           intermediate_size=2048, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def keyed_server(paced_model: Path) -> Iterator[ServeProcess]:
    args = ("--model", str(paced_model), "--served-model-name", "paced", "--kv-tokens", "40000", "--host-kv-tokens",
            "1024")
    with ServeProcess(*args, env={"PIE_API_KEY": KEY}) as process:
        process.wait_ready()
        yield process
        assert process.stop() == 0, process.log


@pytest.fixture(scope="module")
def protected_server(tiny_model: Path) -> Iterator[ServeProcess]:
    """A key and --protect-probes: the page and its endpoints take the key too (so /health does: open_page waits)."""
    args = ("--model", str(tiny_model), "--served-model-name", "tiny", "--protect-probes")
    with ServeProcess(*args, env={"PIE_API_KEY": KEY}) as process:
        yield process
        assert process.stop() == 0, process.log


@pytest.fixture(scope="module")
def open_server(long_model: Path) -> Iterator[ServeProcess]:
    """No key, and the tiny model with an 8192-token context: answers of thousands of tokens in seconds."""
    with ServeProcess("--model", str(long_model), "--served-model-name", "tiny", "--kv-tokens", "16384") as process:
        process.wait_ready()
        yield process
        assert process.stop() == 0, process.log


@pytest.fixture(scope="module")
def expect(browser: Any) -> Any:
    from playwright.sync_api import expect

    return expect


NETWORK_ERROR = "Failed to load resource: "
"""What Chromium logs for a request answered 4xx or 5xx, or not answered: the tests cause those on purpose (a 401
that makes the page ask for the key, a 503 while the server drains, a server killed), and no page can keep them
out of the console. Anything else the page logs, a CSP violation among them, fails the test."""


@contextmanager
def watched_page(browser: Any, **options: Any) -> Iterator[Any]:
    """A tab in a browser context of its own (``options``); what the page logs fails the test."""
    context = browser.new_context(viewport=VIEWPORT, **options)
    context.set_default_timeout(WAIT_MS)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    tab.on("console", lambda message: errors.append(f"{message.type}: {message.text}")
           if message.type in ("error", "warning") and not message.text.startswith(NETWORK_ERROR) else None)
    yield tab
    context.close()
    assert not errors, f"errors and warnings in the page: {errors}"


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    with watched_page(browser) as tab:
        yield tab


@pytest.fixture
def basic_page(browser: Any) -> Iterator[Any]:
    """A tab whose browser was given the key at its login prompt (HTTP Basic), as for a --protect-probes server."""
    with watched_page(browser, http_credentials={"username": "", "password": KEY}) as tab:
        yield tab



AT_LEAST_2 = re.compile(r"^([2-9]|\d{2,})(\.\d+)?$")
ABOVE_0 = re.compile(r"^(?!0\.0$)\d+\.\d$")


def open_page(page: Any, server: ServeProcess, expect: Any) -> None:
    page.goto(f"{server.url}/")
    expect(page.locator("#phase")).to_have_text("ready")
    expect(page.locator("#plan")).to_have_text(re.compile(r"^Poem plan on cpu:0"))


def send(page: Any, text: str, *, max_tokens: int, temperature: float = 0.0) -> Any:
    """Type a message and press Enter; returns the locator of the answer it starts."""
    answers = page.locator("#messages li.assistant").count()
    page.fill("#temperature", str(temperature))
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    answer = page.locator("#messages li.assistant").nth(answers)
    answer.wait_for()
    return answer


def ignoring_eos(route: Any) -> None:
    """Let a chat request from the page ask for every token it names (a random model may stop at any)."""
    body = json.loads(route.request.post_data)
    route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))


def test_the_page_asks_for_the_key_streams_an_answer_and_stops_one(keyed_server: ServeProcess, page: Any, expect: Any) -> None:
    open_page(page, keyed_server, expect)
    answer = send(page, CHAT[0]["content"], max_tokens=24)
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    assert "needs an API key" in page.text_content("#key-why")
    page.fill("#key", KEY)
    page.click("#key-ok")
    answer.and_(page.locator(".done")).wait_for()
    assert page.evaluate("sessionStorage.getItem('pie-api-key')") == KEY
    assert int(answer.get_attribute("data-chunks")) > 1  # it arrived in pieces
    assert "24 tokens" in answer.locator(".meta").text_content() and "finish: length" in answer.text_content()
    api = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    same = api.chat.completions.create(model="paced", messages=CHAT, max_tokens=24, temperature=0, top_p=1)
    assert answer.locator(".text").text_content() == same.choices[0].message.content

    finished = keyed_server.metrics()
    page.route("**/v1/chat/completions", ignoring_eos)
    long = send(page, "And then?", max_tokens=LONG)
    expect(long.locator(".text")).to_have_text(re.compile(r"[\s\S]{40}"))  # streaming
    assert keyed_server.metrics()["pie:requests_running"] == 1
    page.click("#stop")
    long.and_(page.locator(".stopped")).wait_for()
    assert "stopped after" in long.locator(".meta").text_content()
    assert wait_until(lambda: keyed_server.metrics()["pie:requests_running"] == 0, timeout=20)
    now = keyed_server.metrics()
    assert now["pie:kv_pages_used"] == 0  # the cancelled request's pages were released
    length = "pie:finished_choices_total{finish_reason=length}"
    assert now[length] == finished[length]  # it did not run to its 8000 tokens: it was cancelled
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    page.unroute("**/v1/chat/completions")


def test_the_runtime_view_follows_a_background_load(
    keyed_server: ServeProcess, page: Any, expect: Any, tmp_path: Path
) -> None:
    page.add_init_script(f"sessionStorage.setItem('pie-api-key', {json.dumps(KEY)})")  # a key given before
    open_page(page, keyed_server, expect)
    expect(page.locator("#running")).to_have_text("0")
    expect(page.locator("#kv-legend")).to_contain_text(f"; host pool: 0 of {1024 // 16} pages in use")
    steps = int(page.text_content("#steps"))
    generated = keyed_server.metrics()["pie:generation_tokens_total"]
    api = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def one(index: int) -> int:
        reply = api.chat.completions.create(
            model="paced", messages=[{"role": "user", "content": f"Request {index}: go on."}], max_tokens=1200,
            temperature=0, extra_body={"ignore_eos": True})
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(3) as load:
        replies = [load.submit(one, index) for index in range(3)]
        expect(page.locator("#running")).to_have_text(AT_LEAST_2)
        expect(page.locator("#batch")).to_have_text(AT_LEAST_2)  # the decode steps are batched
        expect(page.locator("#kv-bar")).to_have_attribute("aria-label", re.compile(r"KV pages: [1-9]\d* used"))
        assert int(page.text_content("#steps")) > steps
        answer = send(page, "Meanwhile, a short one.", max_tokens=8)
        answer.and_(page.locator(".done")).wait_for()
        assert [reply.result(timeout=120) for reply in replies] == [1200] * 3
    expect(page.locator("#running")).to_have_text("0")
    expect(page.locator("#gen-rate")).to_have_text(ABOVE_0)
    assert page.get_attribute("#spark-gen", "points").count(",") >= 2  # a line, not a point
    assert keyed_server.metrics()["pie:generation_tokens_total"] >= generated + 3 * 1200 + 8
    assert page.locator("#key-dialog").is_hidden()  # the stored key was used without asking
    page.click("#runtime summary")  # open the plan for the picture
    shot = tmp_path / "pie-serve-page.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width == VIEWPORT["width"] and height >= VIEWPORT["height"]
    assert 20_000 < len(data) < 5_000_000


def test_without_a_key_it_chats_at_once_and_says_when_the_server_drains(
    paced_model: Path, page: Any, expect: Any
) -> None:
    args = ("--model", str(paced_model), "--served-model-name", "paced", "--kv-tokens", "20000", "--drain-seconds", "60")
    with ServeProcess(*args) as server:
        server.wait_ready()
        open_page(page, server, expect)
        answer = send(page, CHAT[0]["content"], max_tokens=6)
        answer.and_(page.locator(".done")).wait_for()
        assert page.locator("#key-dialog").is_hidden()

        release = threading.Event()
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def in_flight() -> None:  # holds the drain open until released
            stream = api.chat.completions.create(model="paced", messages=CHAT, max_tokens=LONG, stream=True,
                                                 extra_body={"ignore_eos": True})
            with stream:
                for _ in stream:
                    if release.is_set():
                        break

        holder = threading.Thread(target=in_flight, daemon=True)
        holder.start()
        try:
            assert wait_until(lambda: server.metrics()["pie:requests_running"] == 1, timeout=30)
            server.process.send_signal(signal.SIGTERM)
            expect(page.locator("#phase")).to_have_text("draining")
            expect(page.locator("#notices")).to_contain_text("shutting down")
            refused = send(page, "Still there?", max_tokens=6)
            refused.and_(page.locator(".failed")).wait_for()
            assert "shutting down" in refused.locator(".meta").text_content()
            assert page.input_value("#prompt") == "Still there?"  # given back, to send again later
        finally:
            release.set()
            holder.join(30)
        assert server.process.wait(30) == 0, server.log
        expect(page.locator("#phase")).to_have_text("unreachable")
        expect(page.locator("#notices")).to_contain_text("cannot reach the server")


def test_with_protected_probes_the_browser_gives_the_key_and_the_chat_asks_for_it_too(
    protected_server: ServeProcess, basic_page: Any, expect: Any
) -> None:
    page = basic_page
    open_page(page, protected_server, expect)  # the page, and the live view after it, on the browser's Basic key
    assert page.locator("#key-dialog").is_hidden()
    answer = send(page, CHAT[0]["content"], max_tokens=4)
    page.locator("#key-dialog").wait_for(state="visible")
    # The chat does not send the browser's Basic key, which the API never takes: the dialog says how the key goes.
    expect(page.locator("#key-why")).to_have_text(
        "The server answered: this server needs an API key: send the header 'Authorization: Bearer <key>'")
    page.fill("#key", KEY)
    page.press("#key", "Enter")
    answer.and_(page.locator(".done")).wait_for()
    assert "4 tokens" in answer.locator(".meta").text_content()


def test_with_protected_probes_a_chat_key_declined_leaves_the_runtime_view_on_the_browsers_key(
    protected_server: ServeProcess, basic_page: Any, expect: Any
) -> None:
    """The chat sent the browser's Basic key, which the API refuses: Chromium then forgot it, and after a Cancel in
    the key dialog every poll of the runtime view was refused, for as long as the page stayed open."""
    page = basic_page
    open_page(page, protected_server, expect)
    answer = send(page, CHAT[0]["content"], max_tokens=4)
    page.click("#key-dialog button[value=cancel]")
    answer.and_(page.locator(".failed")).wait_for()
    steps = page.text_content("#steps")
    api = openai.OpenAI(base_url=f"{protected_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    expect(page.locator("#steps")).not_to_have_text(steps)  # the polls go on, on the browser's key
    expect(page.locator("#phase")).to_have_text("ready")


def test_a_status_refused_for_its_key_says_a_key_is_needed(protected_server: ServeProcess, basic_page: Any,
                                                            expect: Any) -> None:
    """Every failed poll was "unreachable", a 401 from a server that answers every second among them."""
    page = basic_page
    page.add_init_script("sessionStorage.setItem('pie-api-key', 'wrong')")  # a key of the server's last run
    page.goto(f"{protected_server.url}/")
    expect(page.locator("#key-why")).to_have_text("The server answered: incorrect API key")  # the poll asks
    page.click("#key-dialog button[value=cancel]")
    expect(page.locator("#phase")).to_have_text("key needed")
    expect(page.locator("#notices")).to_contain_text("The runtime view needs this server's API key: incorrect API key")


def test_a_key_declined_for_the_runtime_view_slows_its_polls_and_can_be_given_later(
    protected_server: ServeProcess, basic_page: Any, expect: Any
) -> None:
    """After a Cancel in the key dialog the runtime view asked the server every second for good, each answer a 401,
    and the page offered no way to give the key but to send a chat message."""
    page = basic_page
    page.add_init_script("sessionStorage.setItem('pie-api-key', 'wrong')")
    page.goto(f"{protected_server.url}/")
    page.click("#key-dialog button[value=cancel]")
    notices = page.locator("#notices")
    expect(notices).to_contain_text("the page asks the server again in 2 s")
    expect(notices).to_contain_text("the page asks the server again in 4 s")  # and so on, up to a minute
    page.set_viewport_size({"width": 360, "height": 740})
    assert page.evaluate(OVERFLOWING) == []  # the header's button too
    page.click("#enter-key")
    expect(page.locator("#key-why")).to_have_text("The server answered: incorrect API key")
    page.fill("#key", KEY)
    page.press("#key", "Enter")
    expect(page.locator("#phase")).to_have_text("ready")
    expect(page.locator("#plan")).to_have_text(re.compile(r"^Poem plan on cpu:0"))
    expect(notices).to_be_empty()
    assert page.locator("#enter-key").is_hidden()


def test_the_max_tokens_field_fits_the_models_context(server: ServeProcess, page: Any, expect: Any) -> None:
    """Its default was 256 whatever the model: on one whose context is 256 tokens every message failed with a 400."""
    open_page(page, server, expect)  # context 256, KV cache 4096
    field = page.locator("#max_tokens")
    expect(field).to_have_value("64")
    assert field.get_attribute("max") == "255"
    page.fill("#prompt", CHAT[0]["content"])
    page.press("#prompt", "Enter")
    answer = page.locator("#messages li.assistant")
    answer.and_(page.locator(".done, .failed")).wait_for()
    assert answer.get_attribute("class") == "assistant done", answer.text_content()
    page.fill("#max_tokens", "256")  # the browser's form check says so on send
    assert field.evaluate("field => field.validity.rangeOverflow")


def test_a_server_that_answers_status_with_an_error_is_not_called_unreachable(server: ServeProcess, page: Any,
                                                                              expect: Any) -> None:
    """A 500 from a server that is up was "unreachable", its message put as if the network had failed."""
    fault = APIError(500, "internal error: RuntimeError: the server's own bug")  # a fault's answer, as the server's
    page.route("**/v1/pie/status", lambda route: route.fulfill(status=500, json=fault.body()))
    page.goto(f"{server.url}/")
    expect(page.locator("#phase")).to_have_text("error")
    expect(page.locator("#notices")).to_contain_text(
        "The server answered the runtime view with an error: internal error: RuntimeError: the server's own bug")
    page.unroute("**/v1/pie/status")
    expect(page.locator("#phase")).to_have_text("ready")
    expect(page.locator("#notices")).to_be_empty()


TEXT_NODES_REPLACED = """
window.textNodesReplaced = 0;
document.addEventListener("DOMContentLoaded", () => new MutationObserver((records) => {
  for (const record of records) {
    if (record.target.classList && record.target.classList.contains("text")) {
      window.textNodesReplaced += record.removedNodes.length;
    }
  }
}).observe(document.getElementById("messages"), { subtree: true, childList: true }));
"""


def test_a_long_answer_grows_in_place_and_the_transcript_follows_it(open_server: ServeProcess, page: Any,
                                                                      expect: Any) -> None:
    """Each token set the answer's whole text again (a tab laid out thousands of characters per token, and froze on
    long answers), and the transcript stayed where the answer began while it streamed out of sight below."""
    page.set_viewport_size({"width": 800, "height": 600})
    page.add_init_script(TEXT_NODES_REPLACED)
    open_page(page, open_server, expect)
    page.route("**/v1/chat/completions", ignoring_eos)
    answer = send(page, "Go on at length.", max_tokens=2000)
    answer.and_(page.locator(".done")).wait_for()
    assert int(answer.get_attribute("data-chunks")) > 1000
    assert page.evaluate("window.textNodesReplaced") == 0
    transcript = page.locator("#messages")
    height, top, shown = (transcript.evaluate(f"list => list.{name}")
                          for name in ("scrollHeight", "scrollTop", "clientHeight"))
    assert height > 2 * shown and top + shown >= height - 8  # at its end
    page.unroute("**/v1/chat/completions")


def test_a_lost_device_is_not_called_a_failed_load(tiny_model: Path, page: Any, expect: Any) -> None:
    """Phase "failed" of a running `pie serve` is a lost device (a model that does not load ends the server), and the
    page said "The model failed to load: the device was lost: ..."."""
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    program = list(llm.runner.plan._program)
    _, inputs, output, name = program[0]

    def losing_the_device(*args: object) -> object:
        raise DeviceLost("the browser's page was closed")

    program[0] = (losing_the_device, inputs, output, name)
    llm.runner.plan._program = tuple(program)
    with in_process(ServerState(ServeSettings(served_model_name="tiny"), llm)) as url:
        page.goto(f"{url}/")
        expect(page.locator("#phase")).to_have_text("ready")
        send(page, CHAT[0]["content"], max_tokens=4).and_(page.locator(".failed")).wait_for()
        expect(page.locator("#phase")).to_have_text("failed")
        expect(page.locator("#notices")).to_contain_text("The server cannot serve: the device was lost: kernel ")
        assert "failed to load" not in page.text_content("#notices")


def test_a_restarted_server_is_shown_as_it_now_is(tiny_model: Path, long_model: Path, page: Any,
                                                  expect: Any) -> None:
    """The page read the plan once: a server restarted with another model (or KV cache) was shown with the engine,
    device, KV cache and plan of the one before, for as long as the page stayed open. And while the server was down
    the page said so in the browser's words: "Failed to fetch"."""
    with ServeProcess("--model", str(tiny_model), "--kv-tokens", "4096") as first:
        first.wait_ready()
        open_page(page, first, expect)
        expect(page.locator("#kv-size")).to_contain_text("4096 tokens; context 256;")
        asked: list[str] = []
        page.on("request", lambda request: asked.append(request.url.removeprefix(first.url)))
        first.process.kill()
        first.process.wait(30)
        expect(page.locator("#phase")).to_have_text("unreachable")
        expect(page.locator("#notices")).to_contain_text("cannot reach the server: the connection to the server failed")
        refused = send(page, "Anyone there?", max_tokens=4)
        expect(refused.locator(".meta")).to_have_text("failed: the connection to the server failed")
    port = first.url.rsplit(":", 1)[1]
    with ServeProcess("--model", str(long_model), "--kv-tokens", "8192", "--port", port) as second:
        assert second.url == first.url
        second.wait_ready()
        expect(page.locator("#phase")).to_have_text("ready")
        expect(page.locator("#kv-size")).to_contain_text("8192 tokens; context 8192;")
        expect(page.locator("#kv-legend")).to_contain_text(f"of {8192 // 16} pages")
        assert second.stop() == 0, second.log
    # While the server was down and after, the page never reloaded itself, and it read the new plan once.
    assert set(asked) == {"/v1/pie/status", "/v1/pie/plan", "/v1/chat/completions"}, set(asked)
    assert asked.count("/v1/pie/plan") == 1 and asked.count("/v1/chat/completions") == 1


def test_right_to_left_text_is_laid_out_right_to_left(open_server: ServeProcess, page: Any, expect: Any) -> None:
    """An Arabic or Hebrew message was laid out left to right, its end punctuation on the wrong side, in the box as
    typed and in the transcript."""
    open_page(page, open_server, expect)
    arabic = "مرحبا بالعالم! كيف حالك؟"
    page.fill("#system", arabic)
    page.fill("#prompt", arabic)
    direction = "element => getComputedStyle(element).direction"
    assert page.locator("#prompt").evaluate(direction) == page.locator("#system").evaluate(direction) == "rtl"
    send(page, arabic, max_tokens=4).and_(page.locator(".done")).wait_for()
    assert page.locator("#messages li.user .text").evaluate(direction) == "rtl"
    page.fill("#prompt", "And in English?")
    assert page.locator("#prompt").evaluate(direction) == "ltr"
    send(page, "And in English?", max_tokens=4).and_(page.locator(".done")).wait_for()
    assert page.locator("#messages li.user .text").nth(1).evaluate(direction) == "ltr"


OVERFLOWING = """() => [...document.querySelectorAll("body *")]
  .filter((element) => element.clientWidth > 0 && element.scrollWidth > element.clientWidth + 1
    && getComputedStyle(element).overflowX === "visible")
  .map((element) => `${element.tagName}#${element.id}.${element.className}`)"""


def test_nothing_spills_out_of_its_box_on_a_phone_or_a_wide_screen(open_server: ServeProcess, page: Any,
                                                                 expect: Any) -> None:
    """At 360 px the runtime's numbers were four columns of 50 px: "Preemptions" ran into the next cell."""
    open_page(page, open_server, expect)
    send(page, CHAT[0]["content"], max_tokens=16).and_(page.locator(".done")).wait_for()
    expect(page.locator("#batch")).to_have_text(re.compile(r"\d|idle"))
    page.click("#runtime summary")
    for width in (360, 2560):
        page.set_viewport_size({"width": width, "height": 740})
        assert page.evaluate(OVERFLOWING) == [], width
        assert page.evaluate("document.documentElement.scrollWidth") == width


COLORS = """(element, part) => {
  const parse = (color) => color.match(/[\\d.]+/g).map(Number);
  let behind = element;
  while (parse(getComputedStyle(behind).backgroundColor)[3] === 0) behind = behind.parentElement;
  return [parse(getComputedStyle(element, part).color), parse(getComputedStyle(behind).backgroundColor)];
}"""


def contrast(colors: list[list[float]]) -> float:
    """WCAG's contrast ratio of a text colour and its background (opaque)."""
    def luminance(rgb: list[float]) -> float:
        linear = [c / 255 / 12.92 if c / 255 <= 0.03928 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    light, dark = sorted(map(luminance, colors), reverse=True)
    return (light + 0.05) / (dark + 0.05)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_phase_and_the_small_text_are_readable_in_both_colour_schemes(
    open_server: ServeProcess, page: Any, expect: Any, scheme: str
) -> None:
    """The phase badge said "loading" and "draining" at 4.1:1 (light) and "ready" at 3.5:1 (dark), and the seed's
    placeholder ("none") was Chromium's grey at 4.45:1 and 3.9:1, under the 4.5:1 that WCAG AA asks of text this
    size."""
    page.emulate_media(color_scheme=scheme)
    open_page(page, open_server, expect)
    badge = page.locator("#phase")
    for phase in ("ready", "loading", "draining", "failed", "unreachable", "key needed", "error"):
        badge.evaluate(f"badge => {{ badge.dataset.phase = '{phase}'; }}")
        assert contrast(badge.evaluate(COLORS)) >= 4.5, (scheme, phase)
    for muted in ("#model", ".help", ".numbers dt", "figcaption", ".setup dt", "#send", "#clear"):
        assert contrast(page.locator(muted).first.evaluate(COLORS)) >= 4.5, (scheme, muted)
    assert contrast(page.locator("#seed").evaluate(COLORS, "::placeholder")) >= 4.5, scheme


def test_a_wrong_key_is_asked_for_again_and_declined_it_is_called_wrong(keyed_server: ServeProcess, page: Any,
                                                                         expect: Any) -> None:
    """A wrong key, then Cancel, failed the message with "incorrect API key (no API key given)"."""
    open_page(page, keyed_server, expect)
    answer = send(page, CHAT[0]["content"], max_tokens=4)
    page.fill("#key", "wrong")
    page.press("#key", "Enter")
    expect(page.locator("#key-why")).to_have_text("The server answered: incorrect API key")
    page.click("#key-dialog button[value=cancel]")
    answer.and_(page.locator(".failed")).wait_for()
    assert answer.locator(".meta").text_content() == "failed: incorrect API key"
    assert page.input_value("#prompt") == CHAT[0]["content"]  # given back, to send with the right key
    page.press("#prompt", "Enter")
    expect(page.locator("#key-why")).to_have_text("The server answered: incorrect API key")
    page.fill("#key", KEY)
    page.press("#key", "Enter")
    page.locator("#messages li.assistant.done").wait_for()


def test_markup_in_the_model_output_and_in_a_message_is_shown_as_text(open_server: ServeProcess, page: Any,
                                                                     expect: Any) -> None:
    markup = '<img src=x onerror="document.title=1"><script>document.title=2</script><b>bold</b>'
    chunks = [{"choices": [{"index": 0, "delta": {"content": markup[i:i + 7]}, "finish_reason": None}]}
              for i in range(0, len(markup), 7)]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    stream = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions",
               lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream))
    open_page(page, open_server, expect)
    answer = send(page, markup, max_tokens=8)
    answer.and_(page.locator(".done")).wait_for()
    assert page.locator("#messages li.user .text").text_content() == markup
    assert answer.locator(".text").text_content() == markup
    assert page.locator("#messages img, #messages script, #messages b").count() == 0
    assert page.title() == "pie serve"


def test_the_keyboard_sends_from_the_send_button_and_stops_from_where_the_focus_goes(
    open_server: ServeProcess, page: Any, expect: Any
) -> None:
    """Send, pressed from the keyboard, was disabled under the focus: the focus fell to the page's start, and the
    user had to find Stop again (or know of Escape)."""
    open_page(page, open_server, expect)
    page.route("**/v1/chat/completions", ignoring_eos)
    page.fill("#max_tokens", "4000")
    page.focus("#prompt")
    page.keyboard.type("Go on.")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "send"
    page.keyboard.press("Enter")
    answer = page.locator("#messages li.assistant")
    expect(answer.locator(".text")).to_have_text(re.compile(r"[\s\S]{20}"))  # streaming
    assert page.evaluate("document.activeElement.id") == "stop"
    page.keyboard.press("Enter")
    answer.and_(page.locator(".stopped")).wait_for()
    assert page.evaluate("document.activeElement.id") == "prompt"
    page.unroute("**/v1/chat/completions")
