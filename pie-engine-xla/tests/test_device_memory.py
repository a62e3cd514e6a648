"""The XLA engine's device running out of memory: the MemoryError every engine raises for it."""

from __future__ import annotations

from pie.testing.device_memory import exhaust_device_memory


def test_a_page_pool_the_device_has_no_memory_for_is_a_memory_error_and_the_device_goes_on() -> None:
    """It was a bare JaxRuntimeError (RESOURCE_EXHAUSTED): `pie run` called it an internal error (exit 70), and `pie
    serve` answered a request with it where the CPU engine names a MemoryError."""
    found = exhaust_device_memory("xla")
    assert found["raised"] == "OutOfDeviceMemory" and found["after"] == "usable", found  # the kit's MemoryError
    assert found["message"].startswith("xla:0 (cpu) could not allocate device memory: RESOURCE_EXHAUSTED: "), found
    assert found["message"].endswith(" (in a page pool's allocation)"), found
