"""Fifty JSON schemas generated on a tiny random model with random sampling: every finished output validates.

All of them at once, two samples each, through one inferlet (so the outputs are batched together, each
context with its own matcher), checked with the `jsonschema` package and its format checker. A schema the
grammar engine does not implement is refused up front, naming the keyword, never generated loosely.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from json_schemas import SCHEMAS

from pie.generation import SamplingParams
from pie.generation.constraints import GrammarError, OutputIncomplete
from pie.inferlet import InferletHost
from pie.runtime.llm import LLM
from pie.scheduler import BatchScheduler, Scheduler
from pie.testing.models import make_gguf_model

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="constrained generation needs the grammar extra")

SAMPLES = 2
MAX_TOKENS = 160
REFUSED = {
    "unique_tags": "uniqueItems",
    "min_max_properties": "min/maxProperties",
}
"""Schemas llguidance refuses (it does not implement these keywords), with what its message names."""


def format_checker() -> Any:
    """jsonschema's checker, with date-time and time as RFC 3339 has them (leap second 60 included)."""
    checker = jsonschema.FormatChecker()

    def rfc3339(text: str, with_date: bool) -> bool:
        value = text.replace("Z", "+00:00").replace("z", "+00:00").replace(":60", ":59")
        if with_date:
            date, sep, time = value.partition("T" if "T" in value else "t")
            if not sep:
                return False
            datetime.date.fromisoformat(date)
            value = time
        parsed = datetime.time.fromisoformat(value)
        return parsed.tzinfo is not None

    checker.checks("date-time", raises=ValueError)(lambda text: rfc3339(text, True))
    checker.checks("time", raises=ValueError)(lambda text: rfc3339(text, False))
    return checker


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> InferletHost:
    """A tiny random model with flat logits (the sampler's choices are really random), room for every context."""
    path = make_gguf_model(tmp_path_factory.mktemp("schemas") / "flat.gguf", "F32", seed=5)
    llm = LLM.load(str(path), "cpu", max_cached_tokens=len(SCHEMAS) * SAMPLES * 256)
    return InferletHost(Scheduler(BatchScheduler(llm.runner)), llm.tokenizer, timeout_s=600)


def test_fifty_schemas_every_finished_output_validates(host: InferletHost) -> None:
    async def main(ctx: Any, args: list[str]) -> dict[str, Any]:
        async def one(name: str, schema: dict[str, Any], seed: int) -> tuple[str, str, str | None]:
            context = ctx.context("Answer in JSON:")
            try:
                text = await context.generate(MAX_TOKENS, sampling=SamplingParams(temperature=1.0, seed=seed),
                                              json_schema=schema)
            except OutputIncomplete:
                return name, "incomplete", None
            except GrammarError as exc:
                return name, "refused", str(exc)
            finally:
                context.drop()
            return name, "finished", text

        jobs = [one(name, schema, seed) for name, schema in SCHEMAS for seed in range(SAMPLES)]
        return {"outcomes": await asyncio.gather(*jobs)}

    result = asyncio.run(host.run(main, [], name="schemas"))
    assert result.ok, result.details or result.error
    checker = format_checker()
    schemas = dict(SCHEMAS)
    finished: dict[str, int] = {}
    for name, outcome, text in result.value["outcomes"]:
        if name in REFUSED:
            assert outcome == "refused" and REFUSED[name] in text, (name, outcome, text)
            continue
        assert outcome != "refused", (name, text)
        if outcome == "finished":
            finished[name] = finished.get(name, 0) + 1
            validator = jsonschema.Draft202012Validator(schemas[name], format_checker=checker)
            errors = [error.message for error in validator.iter_errors(json.loads(text))]
            assert not errors, (name, text, errors)
    compiled = len(SCHEMAS) - len(REFUSED)
    assert len(finished) >= compiled * 0.8, f"only {len(finished)} of {compiled} schemas had a finished output"
    assert sum(finished.values()) >= compiled * SAMPLES * 0.6


def test_the_schema_file_is_fifty_distinct_schemas() -> None:
    assert len(SCHEMAS) == 50 and len({json.dumps(s, sort_keys=True) for _, s in SCHEMAS}) == 50
    assert Path(__file__).with_name("json_schemas.py").exists()
