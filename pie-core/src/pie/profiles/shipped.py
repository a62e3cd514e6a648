"""Reading the profiles an engine ships as package data (for its ``pie_device_profiles`` hook)."""

from __future__ import annotations

from importlib import resources


def shipped_profiles(package: str, folder: str = "profiles") -> list[str]:
    """TOML texts of ``package``'s ``profiles/*.toml``, in name order (none when the folder is absent)."""
    root = resources.files(package) / folder
    if not root.is_dir():
        return []
    entries = sorted((entry for entry in root.iterdir() if entry.name.endswith(".toml")), key=lambda e: e.name)
    return [entry.read_text(encoding="utf-8") for entry in entries]
