"""Host Python lines per engine, the shared engine kit, and the emulators, counted from the tree.

    python benchmarks/engine_lines.py          # a table
    python benchmarks/engine_lines.py --json   # the same numbers, per file as well

An engine's host code is ``pie-engine-*/src/**/*.py``; kernel sources (.c, .cu, .metal, .slang)
are not Python and so never counted, and generated files (under a ``generated`` folder, or
marked ``@generated``) are left out. The CPU emulators of CUDA and Metal are counted apart from
their engine, wherever they live, since they are test equipment rather than engine code. The
shared kit is ``pie-core/src/pie/enginekit`` (its Slang launch layer, ``enginekit/shaders``, included).
``code`` counts lines that are neither blank nor comments; ``total`` counts every line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

EMULATORS = {
    "cuda": ("pie-engine-cuda/tests/emulator_api.py",),
    "metal": ("pie-engine-metal/tests/msl_emulator/*.py",),
}
"""Per engine, the files (globs under the root) of its CPU emulator."""
KIT = ("pie-core/src/pie/enginekit/**/*.py",)


@dataclass(frozen=True)
class FileCount:
    path: str
    code: int
    total: int


@dataclass
class Group:
    """One row of the table: a set of files and the sums of their counts."""

    name: str
    kind: str
    """``engine``, ``kit`` or ``emulator``."""
    files: list[FileCount] = field(default_factory=list)

    @property
    def code(self) -> int:
        return sum(f.code for f in self.files)

    @property
    def total(self) -> int:
        return sum(f.total for f in self.files)


def count_file(path: Path) -> tuple[int, int]:
    """(code lines, total lines) of one Python file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    code = sum(1 for line in lines if line.strip() and not line.lstrip().startswith("#"))
    return code, len(lines)


def is_generated(path: Path, root: Path) -> bool:
    if "generated" in path.relative_to(root).parts:
        return True
    with path.open(encoding="utf-8") as handle:
        head = "".join(handle.readline() for _ in range(5))
    return "@generated" in head


def _files(root: Path, patterns: tuple[str, ...]) -> list[Path]:
    found = {path for pattern in patterns for path in root.glob(pattern) if path.is_file()}
    return sorted(path for path in found if not is_generated(path, root))


def _group(root: Path, name: str, kind: str, paths: list[Path]) -> Group:
    group = Group(name, kind)
    for path in paths:
        code, total = count_file(path)
        group.files.append(FileCount(path.relative_to(root).as_posix(), code, total))
    return group


def count(root: Path = ROOT) -> list[Group]:
    """Every engine (emulator files apart), each emulator, then the shared kit."""
    engines = sorted(p.name.removeprefix("pie-engine-") for p in root.glob("pie-engine-*") if (p / "src").is_dir())
    emulators = {name: _files(root, patterns) for name, patterns in EMULATORS.items() if name in engines}
    emulator_files = {path for paths in emulators.values() for path in paths}
    groups = []
    for name in engines:
        paths = [p for p in _files(root, (f"pie-engine-{name}/src/**/*.py",)) if p not in emulator_files]
        groups.append(_group(root, name, "engine", paths))
    groups.extend(_group(root, f"{name} emulator", "emulator", paths) for name, paths in emulators.items())
    groups.append(_group(root, "shared kit (pie-core)", "kit", _files(root, KIT)))
    return groups


def table(groups: list[Group]) -> str:
    width = max(len(g.name) for g in groups)
    lines = [f"{'':<{width}}  {'kind':<8}  {'files':>5}  {'code':>6}  {'total':>6}"]
    for g in groups:
        lines.append(f"{g.name:<{width}}  {g.kind:<8}  {len(g.files):>5}  {g.code:>6}  {g.total:>6}")
    engines = [g for g in groups if g.kind == "engine"]
    lines.append(
        f"{'engines':<{width}}  {'sum':<8}  {sum(len(g.files) for g in engines):>5}  "
        f"{sum(g.code for g in engines):>6}  {sum(g.total for g in engines):>6}"
    )
    return "\n".join(lines)


def as_json(groups: list[Group]) -> str:
    rows = [
        {"name": g.name, "kind": g.kind, "code": g.code, "total": g.total, "files": [asdict(f) for f in g.files]}
        for g in groups
    ]
    return json.dumps(rows, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the counts as JSON, per file as well")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a folder")
    groups = count(args.root.resolve())
    if not any(g.kind == "engine" for g in groups):
        parser.error(f"no pie-engine-*/src folder under {args.root}")
    print(as_json(groups) if args.json else table(groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
