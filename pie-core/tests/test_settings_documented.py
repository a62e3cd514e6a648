"""Every ``PIE_*`` environment variable the code reads is documented where users look: the root README, an
engine's README or a page under docs/ (four were read by the code and written nowhere)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"PIE_[A-Z0-9_]+")
READERS = {"get", "getenv", "pop", "setdefault", "env_seconds"}
"""Calls whose argument is the name of a variable being read (``os.environ.get``, ``env.get``, ...)."""


def _read_variables(path: Path) -> set[str]:
    """The PIE_ names ``path`` reads: an argument of a reader call, a typer option's ``envvar``, an
    ``environ[...]`` key, or the value of a constant named ``*_ENV``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[ast.expr] = []
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in READERS:
                names = list(node.args)
            names += [keyword.value for keyword in node.keywords if keyword.arg == "envvar"]  # a typer option's
        elif isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
            names = [node.slice]
        elif isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id.endswith("_ENV") for target in node.targets
        ):
            names = [node.value]
        found |= {
            name.value for name in names
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and NAME.fullmatch(name.value)
        }
    return found


def test_the_finder_sees_the_ways_the_code_reads_a_variable(tmp_path: Path) -> None:
    source = tmp_path / "reads.py"
    source.write_text(
        "import os\nA_ENV = 'PIE_ONE'\nos.environ.get('PIE_TWO')\nos.environ['PIE_THREE']\nos.getenv('PIE_FOUR')\n"
        "env_seconds(env, 'PIE_FIVE', 1.0)\ntyper.Option(envvar='PIE_SIX')\nprint('PIE_NOT_READ')\n"
    )
    assert _read_variables(source) == {"PIE_ONE", "PIE_TWO", "PIE_THREE", "PIE_FOUR", "PIE_FIVE", "PIE_SIX"}


def test_every_variable_the_code_reads_is_documented() -> None:
    read: dict[str, Path] = {}
    for path in sorted(ROOT.glob("pie-*/src/**/*.py")):
        for name in _read_variables(path):
            read.setdefault(name, path.relative_to(ROOT))
    assert {"PIE_ENGINES", "PIE_PROBE_CACHE", "PIE_DEBUG", "PIE_PASS_ADDRESS"} <= read.keys(), sorted(read)
    documents = [ROOT / "README.md", *ROOT.glob("pie-*/README.md"), *ROOT.glob("docs/*.md")]
    text = "\n".join(path.read_text(encoding="utf-8") for path in documents)
    undocumented = {name: str(path) for name, path in read.items() if name not in set(NAME.findall(text))}
    assert not undocumented, f"read by the code, documented nowhere: {undocumented}"
