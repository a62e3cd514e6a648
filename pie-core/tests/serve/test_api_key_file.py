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


@pytest.mark.parametrize("key", ["cl\u00e9", "key\x7f", "tab\tkey"])
def test_a_key_in_the_environment_that_a_header_cannot_carry_is_refused(tmp_path: Path, key: str) -> None:
    """The key file's was refused, PIE_API_KEY's taken: a server no client could send its key to."""
    result = CliRunner().invoke(app, ["serve", "--inferlets", str(tmp_path / "none")], env={"PIE_API_KEY": key})
    assert result.exit_code == 1, result.output
    assert "PIE_API_KEY holds characters other than printable ASCII" in " ".join(result.output.split()), result.output
