"""User text and program text encoded from many threads at once, by the tokenizer's one backend."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
