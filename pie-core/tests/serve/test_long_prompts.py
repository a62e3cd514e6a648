"""Long prompts: refused untokenized when they cannot fit the context, and tokenized off the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import tokenizers
import uvicorn
from pie.runtime.llm import LLM
from pie.serve.app import ServerState, ServeSettings, create_app
from pie.testing.models import TOOLS_CHAT_TEMPLATE, make_gguf_model
from pie.testing.serve_process import wait_until

LONG = "hello world " * 2000
"""24,000 bytes: more tokens than the tiny model's context of 256 holds, whatever its vocabulary."""


class RecordingBackend:
    """The tokenizer's backend, noting for each text it encodes its length and whether the event loop's thread
    asked."""

    def __init__(self, backend: tokenizers.Tokenizer):
        self.backend = backend
        self.encoded: list[tuple[int, bool]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def encode(self, text: str, **options: Any) -> Any:
        self.encoded.append((len(text), _on_event_loop()))
        return self.backend.encode(text, **options)

    def encode_batch(self, texts: list[str], **options: Any) -> Any:
        self.encoded += [(len(text), _on_event_loop()) for text in texts]
        return self.backend.encode_batch(texts, **options)


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@contextmanager
def _served(model: Path) -> Iterator[tuple[str, RecordingBackend]]:
    """``model`` served in this process (so its tokenizer can be watched), and its recording backend."""
    llm = LLM.load(str(model), "cpu", max_cached_tokens=2048)
    backend = RecordingBackend(llm.tokenizer.backend)
    llm.tokenizer.backend = backend  # type: ignore[assignment]
    server = uvicorn.Server(uvicorn.Config(create_app(ServerState(ServeSettings(served_model_name="tiny"), llm)),
                                           host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=30)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", backend
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[tuple[str, RecordingBackend]]:
    with _served(tiny_model) as serving:
        yield serving


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(served: tuple[str, RecordingBackend]) -> None:
    # An 8 MiB prompt was tokenized whole (seconds of a core, the GIL held) before the 400 for its length.
    url, backend = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    requests = {
        "prompt": lambda: client.completions.create(model="tiny", prompt=LONG, max_tokens=1),
        "messages": lambda: client.chat.completions.create(model="tiny", max_tokens=1, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG[:12_000]},
            {"role": "user", "content": LONG[12_000:]}]),
    }
    for param, request in requests.items():
        backend.encoded.clear()
        with pytest.raises(openai.BadRequestError, match=r"at least \d+ tokens.* fills the model's context of 256"
                           ) as caught:
            request()
        assert caught.value.body["param"] == param
        assert backend.encoded == [], "nothing was tokenized"


def test_tokenize_counts_a_long_text_off_the_event_loop(served: tuple[str, RecordingBackend]) -> None:
    # /tokenize encoded on the event loop, whatever the length: every other request waited for it.
    url, backend = served
    root = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    for body in ({"prompt": LONG}, {"messages": [{"role": "user", "content": LONG}]}):
        backend.encoded.clear()
        counted = root.post("/tokenize", body=body, cast_to=object)
        assert counted["count"] > counted["max_model_len"], "any text is counted, past the context too"
        assert backend.encoded and not any(on_loop for _, on_loop in backend.encoded)


def test_a_batch_of_short_prompts_long_together_is_tokenized_off_the_event_loop(served: tuple[str, RecordingBackend]
                                                                                ) -> None:
    # Each prompt of a batch was encoded on the event loop where it was short on its own, however many there were:
    # 300 prompts of 8,100 characters held every other request for over a second.
    url, backend = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    backend.encoded.clear()
    reply = client.completions.create(model="tiny", prompt=["hello world " * 10] * 100, max_tokens=1)
    assert len(reply.choices) == 100
    assert len(backend.encoded) == 100 and not any(on_loop for _, on_loop in backend.encoded), backend.encoded


def test_a_batch_of_more_prompts_than_the_server_holds_is_refused_before_it_is_tokenized(
        served: tuple[str, RecordingBackend]) -> None:
    # It was refused once every prompt was tokenized, on the event loop: 400,000 prompts of "ab" held it for 10 s.
    url, backend = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    backend.encoded.clear()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=["ab"] * 321, max_tokens=1)
    assert caught.value.body["param"] == "prompt"
    assert caught.value.body["message"].startswith("a batch of 321 prompts is more than the server holds at once")
    assert backend.encoded == [], "nothing was tokenized"


def test_a_chat_with_tools_is_rendered_and_tokenized_off_the_event_loop(tmp_path: Path) -> None:
    # Tools are not in the messages' text, which alone decided: 3 MB of tools with a short message held every other
    # request (/health too) for 9 s while the chat template rendered them and the tokenizer encoded the result.
    model = make_gguf_model(tmp_path / "tools.gguf", "F32", chat_template=TOOLS_CHAT_TEMPLATE,
                            max_position_embeddings=2048)
    tool = {"type": "function", "function": {"name": "look_up", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}}}}
    with _served(model) as (url, backend):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               tools=[tool], tool_choice="none", max_tokens=1)
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert backend.encoded and not any(on_loop for _, on_loop in backend.encoded), backend.encoded
