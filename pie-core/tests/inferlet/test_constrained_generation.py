"""Constrained generation in inferlets: ctx.generate(json_schema=, regex=, grammar=), matchers, forks, errors,
in-process and served (the worker builds its vocabulary from its own copy of the tokenizer)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pie.inferlet import InferletHost
from pie.model.tokenizer import Tokenizer
from test_served_runs import assert_same, served

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="constrained generation needs the grammar extra")

SCHEMA = {
    "type": "object",
    "properties": {"animal": {"enum": ["fox", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                   "said": {"type": "string", "maxLength": 10}},
    "required": ["animal", "legs", "said"],
    "additionalProperties": False,
}

INFERLET = '''"""Every kind of constraint, generated from one prompt's forks; sampled with fixed seeds."""

import json

from pie.generation import SamplingParams

SCHEMA = json.loads({schema!r})


async def main(ctx, args):
    prompt = ctx.context("The quick brown fox")
    await prompt.flush()
    results = {{}}
    for index, (name, kind) in enumerate([
        ("schema", {{"json_schema": SCHEMA}}),
        ("regex", {{"regex": "[a-z]{{2,4}}-[0-9]{{3}}"}}),
        ("grammar", {{"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'}}),
    ]):
        fork = prompt.fork()
        results[name] = await fork.generate(80, sampling=SamplingParams(temperature=1.0, seed=index), **kind)
        fork.drop()
    return results
'''


def run(host: InferletHost, main: Callable[..., Any], args: list[str] | None = None) -> Any:
    result = asyncio.run(host.run(main, args or [], name="constrained"))
    assert result.ok, result.details or result.error
    return result.value


def check(results: dict[str, str]) -> None:
    jsonschema.validate(json.loads(results["schema"]), SCHEMA)
    assert re.fullmatch(r"[a-z]{2,4}-[0-9]{3}", results["regex"]), results["regex"]
    assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", results["grammar"]), results["grammar"]


@pytest.fixture
def inferlet_file(tmp_path: Path) -> Path:
    path = tmp_path / "every_constraint.py"
    path.write_text(INFERLET.format(schema=json.dumps(SCHEMA)))
    return path


def test_each_kind_of_constraint_in_process_and_served_alike(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, inferlet_file: Path
) -> None:
    from pie.inferlet import load_inferlet

    expected = run(make_host(), load_inferlet(inferlet_file))
    check(expected)
    host = make_host()
    ((outcome, _),) = asyncio.run(served(host, tokenizer, [(inferlet_file, [])]))
    assert outcome.ok, outcome.error
    assert_same(outcome.value, expected)
    assert host.scheduler.core.runner.pages.used_count == 0


def test_a_matcher_token_by_token_with_forks(make_host: Callable[..., InferletHost]) -> None:
    async def main(ctx: Any, args: list[str]) -> Any:
        from pie.generation import SamplingParams

        context = ctx.context("Count:")
        matcher = ctx.matcher(regex="[0-9]{2}(-[0-9]{2})+")
        for _ in range(3):
            await context.step(constraint=matcher)
        children = [(context.fork(), matcher.fork()) for _ in range(4)]
        texts = []
        for seed, (child, own) in enumerate(children):
            sampler = SamplingParams(temperature=1.0, seed=seed)
            tokens = await child.generate_tokens(20, sampling=sampler, constraint=own)
            texts.append((ctx.detokenize(child.tokens[len(context.tokens):]), own.is_accepting, len(tokens)))
        parent_after = matcher.tokens
        return {"prefix": ctx.detokenize(context.tokens[-3:]), "children": texts, "parent_tokens": parent_after}

    value = run(make_host(), main)
    assert value["parent_tokens"] == 3, "the children's tokens never reached the parent's matcher"
    for text, accepting, count in value["children"]:
        assert accepting and count > 0
        assert re.fullmatch(r"[0-9]{2}(-[0-9]{2})+", value["prefix"] + text), (value["prefix"], text)
    assert len({text for text, _, _ in value["children"]}) > 1


def test_max_tokens_before_the_end_raises_with_the_text_so_far(make_host: Callable[..., InferletHost]) -> None:
    async def main(ctx: Any, args: list[str]) -> Any:
        from pie.generation.constraints import OutputIncomplete

        context = ctx.context("JSON:")
        try:
            await context.generate(4, json_schema=SCHEMA)
        except OutputIncomplete as exc:
            return {"text": exc.text, "tokens": len(exc.tokens)}
        return None

    value = run(make_host(), main)
    assert value is not None and value["tokens"] == 4 and value["text"].startswith('{"')


BAD = {
    "schema": (lambda ctx, c: c.generate(5, json_schema={"type": "strin"}),
               "GrammarError: invalid JSON schema: Invalid type: strin"),
    "two": (lambda ctx, c: c.generate(5, regex="[0-9]", json_schema={}), "ValueError: give one output constraint"),
    "grammar": (lambda ctx, c: ctx.matcher(grammar="start: nothing_here"), "GrammarError: invalid grammar"),
    "none": (lambda ctx, c: ctx.matcher(), "ValueError: give exactly one of json_schema, regex, grammar, choice"),
    "not_a_matcher": (lambda ctx, c: c.generate(5, constraint="[0-9]+"), "TypeError: constraint is a matcher"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_constraint_in_an_inferlet_says_why(make_host: Callable[..., InferletHost], name: str) -> None:
    make, says = BAD[name]

    async def main(ctx: Any, args: list[str]) -> Any:
        value = make(ctx, ctx.context("x"))
        return await value if asyncio.iscoroutine(value) else value

    result = asyncio.run(make_host().run(main, [], name="bad"))
    assert not result.ok and says in result.error, result.error
