"""`pie serve --api-key-file`: what it refuses before anything loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pie.cli import app
from typer.testing import CliRunner


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("device", "cannot read it (not a regular file (a character device))"),  # read until memory ran out
        ("fifo", "cannot read it (not a regular file (a FIFO))"),  # waited on for ever
        ("large", "cannot read it (5000 bytes, more than the 4096 it may have)"),
        ("binary", "holds characters other than printable ASCII"),
        ("latin-1", "cannot read it (it is not UTF-8 text (byte 3))"),
        ("empty", "is empty"),
    ],
)
def test_a_key_file_that_holds_no_key_is_refused_naming_it(tmp_path: Path, kind: str, message: str) -> None:
    path = Path("/dev/zero") if kind == "device" else tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind != "device":
        path.write_bytes({"large": b"k" * 5000, "binary": b"key\x00\x7fELF", "latin-1": b"key\xe9",
                          "empty": b" \n"}[kind])
    result = CliRunner().invoke(app, ["serve", "--api-key-file", str(path)])
    assert result.exit_code == 1 and f"--api-key-file {path}" in result.output, result.output
    assert message in " ".join(result.output.split()), result.output
