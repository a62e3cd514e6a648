"""Hostile chat templates: a model's template is a program from a file; `pie` must bound it.

A template that never ends, or that builds text without end, is refused when the model loads (so
`pie run`, `pie plan` and `pie model import` all refuse it) within bounded time and memory, with a
message naming where the template came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pie.testing.models import make_gguf_model, make_hf_model, rewrite_gguf
from memory_bound import max_rss_mb
from pie_process import assert_ok, assert_user_error, run_pie

MAX_RSS_MB = 600
"""What `pie` may grow by, in MB, while it refuses a file that claims sizes."""
MAX_SECONDS = 60

RUNAWAY = {
    "nested-loops": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                     "it took more than 1000000 steps"),
    "recursive-macro": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                        "chat template stopped"),
    "endless-text": ("{% for m in messages %}{{ m.content * 10**10 }}{% endfor %}", "the operator '*' would make a value"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "would make a value of more than"),
    "shared-lists": ("{% set ns = namespace(x=['ab']) %}{% for i in range(64) %}{% set ns.x = [ns.x, ns.x] %}"
                     "{% endfor %}{{ ns.x }}", "would make a value of more than"),
    "padding": ("{{ messages[0].content.center(10**12) }}", "str.center would make a value"),
    "set-block": ("{% set s %}{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}{% endset %}",
                  "it printed more than"),
    "no-such-syntax": ("{% for %}", "does not compile"),
    "sandbox-escape": ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "huge-source": ("{{ messages }}" * 150_000, "at most 131072 are compiled"),  # compiling costs ~1 KB a character
}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "F32")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return make_hf_model(tmp_path_factory.mktemp("hf") / "model")


def _gguf_with(gguf_model: Path, target: Path, template: str) -> Path:
    return rewrite_gguf(gguf_model, target, metadata={"tokenizer.chat_template": template})


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_run_refuses_a_runaway_template(pie_env: dict[str, str], gguf_model: Path, tmp_path: Path, name: str) -> None:
    template, needle = RUNAWAY[name]
    model = _gguf_with(gguf_model, tmp_path / f"{name}.gguf", template)
    result = run_pie("run", "--model", str(model), "hi", env=pie_env, timeout=MAX_SECONDS * 2)
    assert_user_error(result, f"{name}.gguf", "'tokenizer.chat_template'", needle, max_seconds=MAX_SECONDS,
                      max_rss_mb=max_rss_mb(MAX_RSS_MB))


@pytest.mark.parametrize("name", ["nested-loops", "endless-text"])
def test_import_refuses_a_runaway_template_and_stores_nothing(pie_env: dict[str, str], gguf_model: Path,
                                                              tmp_path: Path, name: str) -> None:
    template, needle = RUNAWAY[name]
    model = _gguf_with(gguf_model, tmp_path / "runaway.gguf", template)
    result = run_pie("model", "import", str(model), env=pie_env, timeout=MAX_SECONDS * 2)
    assert_user_error(result, "runaway.gguf", needle, "rendering a sample conversation", max_seconds=MAX_SECONDS,
                      max_rss_mb=max_rss_mb(MAX_RSS_MB))
    assert_ok(run_pie("model", "list", env=pie_env), "no models in")


def test_import_refuses_a_runaway_template_file(pie_env: dict[str, str], hf_model: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(hf_model, tmp_path / "model"))
    (folder / "chat_template.jinja").write_text(RUNAWAY["nested-loops"][0])
    result = run_pie("model", "import", str(folder), env=pie_env, timeout=MAX_SECONDS * 2)
    assert_user_error(result, "chat_template.jinja", "more than 1000000 steps", max_seconds=MAX_SECONDS)


def test_a_template_that_refuses_plain_conversations(pie_env: dict[str, str], hf_model: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(hf_model, tmp_path / "model"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('Conversations must start with a system message') }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert_user_error(run_pie("plan", str(folder), env=pie_env), "tokenizer_config.json",
                      "rejected the conversation at line 1: Conversations must start with a system message",
                      max_seconds=MAX_SECONDS)


def test_a_sound_template_still_runs(pie_env: dict[str, str], gguf_model: Path, tmp_path: Path) -> None:
    looping_only_for_long_prompts = (
        "{% for m in messages %}{% if m.content|length > 10**6 %}{% for a in range(100000) %}{% for b in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model = _gguf_with(gguf_model, tmp_path / "sound.gguf", looping_only_for_long_prompts)
    assert_ok(run_pie("run", "--model", str(model), "--max-tokens", "2", "hi", env=pie_env), max_seconds=MAX_SECONDS)
    assert_ok(run_pie("model", "import", str(model), env=pie_env), "sound", max_seconds=MAX_SECONDS)
