"""The harness itself: it must see a crash, a traceback and a hang for what they are."""

from __future__ import annotations

import pytest

from pie_process import assert_ok, assert_user_error, run_pie


def test_a_clean_error_passes_and_names_the_problem(pie_env: dict[str, str]) -> None:
    result = run_pie("run", "--model", "/nonexistent/model.gguf", "hello", env=pie_env)
    assert_user_error(result, "/nonexistent/model.gguf")


def test_success_is_exit_zero(pie_env: dict[str, str]) -> None:
    assert_ok(run_pie("--version", env=pie_env), "pie ")


def test_a_traceback_is_caught(pie_env: dict[str, str]) -> None:
    fake = run_pie("--version", env=pie_env)
    fake.returncode, fake.stderr = 1, "Traceback (most recent call last):\n  File ...\nValueError: x\n"
    with pytest.raises(AssertionError, match="traceback"):
        assert_user_error(fake, "x")


def test_a_hang_is_killed_in_bounded_time(pie_env: dict[str, str]) -> None:
    result = run_pie("run", "hello", env={**pie_env, "PIE_MODEL_DIR": "/dev/zero/x"}, timeout=0.01)
    assert result.timed_out or result.returncode != 0
    if result.timed_out:
        assert result.returncode < 0  # killed by the signal, and seen as such
        with pytest.raises(AssertionError, match="did not finish"):
            assert_user_error(result)
