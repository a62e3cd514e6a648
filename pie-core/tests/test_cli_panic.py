"""A Rust panic that escapes a command (a BaseException, which `except Exception` misses) is reported like any
other bug of pie: one line naming the report, no traceback."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, processors

from pie.cli import INTERNAL_ERROR_EXIT, PieApp


def test_a_rust_panic_is_an_internal_error_not_a_traceback(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    panicking = PieApp()

    @panicking.command()
    def encode() -> None:
        backend = Tokenizer(models.BPE({"a": 0}, []))
        backend.post_processor = processors.TemplateProcessing(single=["$B"], pair=["$A", "$B"])
        backend.encode("a")  # tokenizers panics: `single` names a second sequence

    with pytest.raises(SystemExit) as exit_info:
        panicking([], prog_name="pie")
    assert exit_info.value.code == INTERNAL_ERROR_EXIT
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pie: internal error: PanicException: index out of bounds") and "full report" in line
