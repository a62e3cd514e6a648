"""A tiny random model served by `pie serve` in a child process, and `openai` clients pointed at it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest

pytest.importorskip("fastapi", reason="pie serve needs the serve extra")

from pie.testing.models import make_gguf_model  # noqa: E402
from pie.testing.serve_process import ServeProcess  # noqa: E402

LONG_CONTEXT = 8192


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Logits spread so greedy choices are never near-ties: runs that batch differently agree exactly."""
    return make_gguf_model(tmp_path_factory.mktemp("serve") / "tiny.gguf", "F32", lm_head_scale=20.0)


@pytest.fixture(scope="session")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an 8192-token context: long generations keep a request in flight for seconds."""
    path = tmp_path_factory.mktemp("serve-long") / "long.gguf"
    return make_gguf_model(path, "F32", lm_head_scale=20.0, max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ServeProcess]:
    with ServeProcess("--model", str(tiny_model), "--served-model-name", "tiny", "--kv-tokens", "4096") as process:
        process.wait_ready()
        yield process
        assert process.stop() == 0, process.log


@pytest.fixture
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def make_aclient(server: ServeProcess) -> Callable[[], openai.AsyncOpenAI]:
    """Makes an async client, to open with ``async with`` inside the test's own event loop: the loop that holds
    its connections is the only one that can close them."""
    return partial(openai.AsyncOpenAI, base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def no_async_client_left_open(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fails a test that leaves an ``openai.AsyncOpenAI`` client open. Such a client, collected later, closes
    itself from ``__del__`` in whatever event loop then runs (another test's), where closing the connections of
    a finished loop fails and is logged there as "Task exception was never retrieved"."""
    made: list[openai.AsyncOpenAI] = []
    make = openai.AsyncOpenAI.__init__

    def make_and_keep(client: openai.AsyncOpenAI, *args: Any, **kwargs: Any) -> None:
        make(client, *args, **kwargs)
        made.append(client)

    monkeypatch.setattr(openai.AsyncOpenAI, "__init__", make_and_keep)
    yield
    left_open = sum(not client.is_closed() for client in made)
    assert not left_open, f"{left_open} of {len(made)} async client(s) left open: close them with `async with`"
