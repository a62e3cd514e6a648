"""The README's structured-output example, run as written against `pie serve` on the real default model."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pie.testing.serve_process import ServeProcess

from pie.model.store import DEFAULT_MODEL, resolve_model

pytestmark = pytest.mark.slow
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="constrained output needs the grammar extra")

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_example() -> str:
    """The first Python block of the README's "Structured output" section."""
    section = README.read_text(encoding="utf-8").split("### Structured output", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[ServeProcess]:
    resolve_model(DEFAULT_MODEL)  # pulled into the store first, if it is not there yet
    with ServeProcess("--model", DEFAULT_MODEL) as process:
        process.wait_ready()
        yield process
        assert process.stop() == 0, process.log


def test_the_readme_example_extracts_a_record_that_validates(smollm2_server: ServeProcess) -> None:
    code = readme_example()
    assert 'base_url="http://127.0.0.1:8000/v1"' in code
    scope: dict[str, object] = {}
    exec(code.replace("http://127.0.0.1:8000", smollm2_server.url).replace("print(", "(lambda *a: None)("), scope)
    reply = scope["reply"]
    choice = reply.choices[0]  # type: ignore[attr-defined]
    assert choice.finish_reason == "stop"
    person = scope["Person"]
    jsonschema.validate(choice.message.parsed.model_dump(), person.model_json_schema())  # type: ignore[attr-defined]
    assert choice.message.parsed == person(name="Maria Lopez", age=34, city="Lisbon")  # type: ignore[operator]
    phone = scope["phone"].choices[0]  # type: ignore[attr-defined]
    assert phone.finish_reason == "stop" and re.fullmatch(r"\+[0-9]{2} [0-9]{3} [0-9]{4}", phone.text)
