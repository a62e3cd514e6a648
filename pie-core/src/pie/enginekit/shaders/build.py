"""Compile the Slang kernels to the shipped SPIR-V and WGSL: ``python -m pie.enginekit.shaders.build``.

``--check`` compiles into a temporary folder and fails when anything differs
from the shipped files (what CI runs). Needs ``pip install slangpy==0.43.1``
(Slang 2026.12, the compiler recorded in ``generated/manifest.json``: another
Slang release may emit different bytes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pie.enginekit.shaders import GENERATED_DIR, MANIFEST, SOURCE_DIR, Entry
from pie.enginekit.shaders.slang import SlangCompiler

_ENTRY = re.compile(r'\[shader\("compute"\)\]\s*\[numthreads\((\d+),\s*(\d+),\s*(\d+)\)\]\s*void\s+(\w+)\s*\(')
_BINDING = re.compile(r"@binding\((\d+)\) @group\(0\) var<(uniform|storage, read|storage, read_write)> (\w+) : (\w+)")
_FIELD = re.compile(r"@align\((\d+)\) (\w+)_\d+ : (\w+),")
_KINDS = {"uniform": "uniform", "storage, read": "read", "storage, read_write": "read_write"}


def entry_points(source_dir: Path = SOURCE_DIR) -> Iterator[tuple[Path, str, tuple[int, int, int]]]:
    """(file, entry name, workgroup size) of every compute entry point, in a stable order."""
    for path in sorted(source_dir.glob("*.slang")):
        for match in _ENTRY.finditer(path.read_text(encoding="utf-8")):
            x, y, z, name = match.groups()
            yield path, name, (int(x), int(y), int(z))


def describe(name: str, source: str, workgroup: tuple[int, int, int], wgsl: str) -> Entry:
    """The manifest entry of a compiled entry point, read back from its WGSL."""
    bindings: list[tuple[int, str]] = []
    params: list[tuple[str, str]] = []
    for match in _BINDING.finditer(wgsl):
        index, space, _, type_name = match.groups()
        bindings.append((int(index), _KINDS[space]))
        if space == "uniform":
            if int(index) != 0:
                raise ValueError(f"{name}: the uniform block must be binding 0, not {index}")
            struct = re.search(r"struct " + re.escape(type_name) + r"\s*\{(.*?)\};", wgsl, re.DOTALL)
            if struct is None:
                raise ValueError(f"{name}: cannot find struct {type_name} in the WGSL")
            fields = _FIELD.findall(struct.group(1))
            # Engines pack the block as consecutive 4-byte scalars: check the layout says so.
            for position, (align, field, kind) in enumerate(fields):
                if kind not in ("u32", "i32", "f32") or (4 * position) % int(align):
                    raise ValueError(f"{name}: uniform field {field} is not a 4-byte scalar at offset {4 * position}")
            params = [(field, kind) for _, field, kind in fields]
    bindings.sort()
    if [i for i, _ in bindings] != sorted({i for i, _ in bindings}):
        raise ValueError(f"{name}: duplicate bindings {bindings}")
    return Entry(name, source, workgroup, tuple(bindings), tuple(params))  # type: ignore[arg-type]


def build(out_dir: Path, compiler: SlangCompiler, source_dir: Path = SOURCE_DIR) -> list[str]:
    """Compile every entry point into ``out_dir`` (stale files removed); returns the file names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    entries: dict[str, dict[str, object]] = {}
    written = [MANIFEST]
    for path, found in itertools.groupby(entry_points(source_dir), key=lambda entry: entry[0]):
        workgroups = {}
        for _, name, workgroup in found:
            if name in entries or name in workgroups:
                raise ValueError(f"entry point {name} is defined twice")
            workgroups[name] = workgroup
        # One request per file and target: the file is parsed and checked once for all its entry points.
        spirv = compiler.compile_entries(path, list(workgroups), "spirv")
        wgsl = compiler.compile_entries(path, list(workgroups), "wgsl")
        for name, workgroup in workgroups.items():
            (out_dir / f"{name}.spv").write_bytes(spirv[name])
            (out_dir / f"{name}.wgsl").write_bytes(wgsl[name])
            written += [f"{name}.spv", f"{name}.wgsl"]
            entries[name] = describe(name, path.name, workgroup, wgsl[name].decode()).to_json()
    manifest = {"compiler": f"slang {compiler.version()}", "entries": entries}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    for stale in out_dir.iterdir():
        if stale.name not in written:
            stale.unlink()
    return sorted(written)


def differences(expected_dir: Path, actual_dir: Path) -> list[str]:
    """File names that differ between two generated folders (missing on either side included)."""
    names = {p.name for p in expected_dir.iterdir()} | {p.name for p in actual_dir.iterdir()}
    return sorted(
        name
        for name in names
        if not (expected_dir / name).is_file()
        or not (actual_dir / name).is_file()
        or (expected_dir / name).read_bytes() != (actual_dir / name).read_bytes()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pie.enginekit.shaders.build", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare a fresh build with the shipped files")
    args = parser.parse_args(argv)
    with SlangCompiler() as compiler:
        if not args.check:
            written = build(GENERATED_DIR, compiler)
            print(f"wrote {len(written)} files to {GENERATED_DIR} with slang {compiler.version()}")
            return 0
        with tempfile.TemporaryDirectory() as scratch:
            build(Path(scratch), compiler)
            changed = differences(GENERATED_DIR, Path(scratch))
    if changed:
        print(
            "shipped shaders are out of date (run python -m pie.enginekit.shaders.build): " + ", ".join(changed), file=sys.stderr
        )
        return 1
    print("shipped shaders match a fresh build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
