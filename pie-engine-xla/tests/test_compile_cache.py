"""Programs compiled by one process are loaded by the next: JAX's persistent cache in the kit's folder for the XLA
engine (``PIE_XLA_CACHE_DIR``), off with ``PIE_XLA_CACHE=0``, and left off with one warning where its folder cannot
be written. Each case runs in a process of its own, as JAX's configuration is the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pie.testing.models import make_gguf_model

CHILD = """
import json, sys
import jax
from jax import monitoring
from pie.runtime.llm import LLM

events = {"hits": 0, "misses": 0}
names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
monitoring.register_event_listener(lambda event, **_: names.get(event) and events.__setitem__(
    names[event], events[names[event]] + 1))
llm = LLM.load(sys.argv[1], "xla", max_cached_tokens=64)
text = "".join(llm.generate("Hello", chat=False, max_tokens=3))
from pie_engine_xla.compile_cache import use_persistent_cache
print(json.dumps({**events, "text": text, "cache": use_persistent_cache()}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32")


def _run(model: Path, **env: str) -> tuple[dict, str]:
    environment = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    environment.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", CHILD, str(model)], env=environment, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_the_next_process_loads_what_the_first_compiled(model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "xla-cache"
    first, _ = _run(model, PIE_XLA_CACHE_DIR=str(folder))
    assert first["cache"] == str(folder) and first["hits"] == 0 and first["misses"] > 0, first
    assert len(list(folder.iterdir())) >= first["misses"]
    second, _ = _run(model, PIE_XLA_CACHE_DIR=str(folder))
    assert second["hits"] >= first["misses"] and second["misses"] == 0, second
    assert second["text"] == first["text"]


def test_the_cache_is_off_when_asked_and_left_off_where_it_cannot_be_written(model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "off"
    off, _ = _run(model, PIE_XLA_CACHE_DIR=str(folder), PIE_XLA_CACHE="0")
    assert off["cache"] == "off (PIE_XLA_CACHE=0)" and off["hits"] == off["misses"] == 0 and not folder.exists()
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    blocked, stderr = _run(model, PIE_XLA_CACHE_DIR=str(in_the_way / "cache"))
    assert blocked["cache"].startswith(f"off ({in_the_way / 'cache'}: ") and blocked["text"] == off["text"]
    assert stderr.count("the XLA compile cache") == 1 and "Error reading persistent compilation cache" not in stderr
