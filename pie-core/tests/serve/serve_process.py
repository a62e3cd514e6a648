"""The serve tests' name for :mod:`pie.testing.serve_process`, which the engines' serve suites share."""

from pie.testing.serve_process import LISTENING, PIE, ServeProcess, named_bytes, wait_until

__all__ = ["LISTENING", "PIE", "ServeProcess", "named_bytes", "wait_until"]
