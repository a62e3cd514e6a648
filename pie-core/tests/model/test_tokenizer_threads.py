"""User text and program text encoded from many threads at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pie.model import load_model


def test_encode_and_encode_text_keep_their_meaning_when_threads_interleave(tiny_gguf_model: Path) -> None:
    tokenizer = load_model(tiny_gguf_model).tokenizer
    control = tokenizer.id_to_token(tokenizer.eos_token_ids[0])
    text = f"hello {control} world"
    as_program, as_user = tokenizer.encode(text), tokenizer.encode_text(text)
    assert tokenizer.eos_token_ids[0] in as_program and tokenizer.eos_token_ids[0] not in as_user

    def encode(i: int) -> tuple[bool, list[int]]:
        user = i % 2 == 0
        return user, tokenizer.encode_text(text) if user else tokenizer.encode(text)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(encode, range(2000)))
    assert all(ids == (as_user if user else as_program) for user, ids in results)
    assert tokenizer.encode(text) == as_program  # the backend is left reading control tokens


@pytest.mark.parametrize("method", ["encode", "encode_text"])
def test_other_threads_run_while_a_long_text_encodes(tiny_gguf_model: Path, method: str) -> None:
    # The backend's one-text encode held the GIL throughout: tokenizing an 8 MiB prompt on a worker thread
    # stopped the event loop and the engine thread for seconds.
    encode = getattr(load_model(tiny_gguf_model).tokenizer, method)
    encoding = threading.Thread(target=encode, args=("hello world " * 40_000,))
    encoding.start()
    ticks = 0  # how often this thread ran meanwhile
    while encoding.is_alive():
        ticks += 1
        time.sleep(0.001)
    assert ticks >= 20, ticks
