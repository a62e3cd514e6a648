"""Whether an inferlet changed pie's own code: under ``pie run`` it runs in pie's process and may replace any of
pie's functions or methods (monkeypatching). When pie then fails, that is the inferlet's doing, and said so, not
an internal error of pie's.

:class:`PieCode` notes the functions, classes and methods of pie's modules (those of ``pie`` and of its engines)
and tells which of them are no longer what they were. Module data (caches, tables) is left out: pie's own code
changes it.
"""

from __future__ import annotations

import sys
from typing import Any


class PieCode:
    """pie's functions, classes and methods as they were when noted."""

    def __init__(self) -> None:
        self._code: dict[str, Any] = {}
        self.note()

    def note(self) -> None:
        """Note the code of pie's modules not noted before (those imported since)."""
        noted = {name.split(":")[0] for name in self._code}
        for name, module in list(sys.modules.items()):
            if name not in noted and module is not None and _is_pie(name):
                self._code.update(_code_of(name, vars(module)))

    def changed(self) -> list[str]:
        """The names (``module.attribute``, ``module.Class.attribute``) of what is no longer what was noted."""
        return [name.replace(":", ".") for name, code in self._code.items() if _now(name) is not code]


def _is_pie(module: str) -> bool:
    return module == "pie" or module.startswith("pie.") or module.startswith("pie_engine_")


def _code_of(module: str, namespace: dict[str, Any]) -> dict[str, Any]:
    code: dict[str, Any] = {}
    for attribute, value in list(namespace.items()):
        if not callable(value):
            continue
        code[f"{module}:{attribute}"] = value
        if isinstance(value, type) and value.__module__ == module:
            for member, method in list(vars(value).items()):
                if callable(method) or isinstance(method, (staticmethod, classmethod, property)):
                    code[f"{module}:{attribute}.{member}"] = method
    return code


def _now(name: str) -> Any:
    module, _, path = name.partition(":")
    owner: Any = sys.modules.get(module)
    *classes, attribute = path.split(".")
    for part in classes:
        owner = vars(owner).get(part) if owner is not None else None
    return vars(owner).get(attribute) if owner is not None else None
