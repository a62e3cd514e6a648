"""A reader for the subset of MSL the Pie kernels are written in.

It finds kernel signatures (argument types, names and attributes), function constants,
structs and inline helpers. The emulator uses it to bind arguments; the tests use it
to check the host's binding table and to lint the sources for things Metal rejects
but C++ would accept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ADDRESS_SPACES = ("device", "constant", "threadgroup", "thread")

# Attributes whose value is a position in the grid (scalar or vector, like thread_position_in_grid).
GRID_ATTRIBUTES = (
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
)
INDEX_ATTRIBUTES = (
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup",
    "simdgroups_per_threadgroup",
)
COLLECTIVE_CALL = re.compile(r"\b(threadgroup_barrier|simdgroup_barrier|simd_\w+|simdgroup_\w+)\s*\(")


@dataclass(frozen=True)
class Param:
    type: str
    name: str
    attribute: str

    @property
    def buffer_index(self) -> int | None:
        match = re.fullmatch(r"buffer\((\d+)\)", self.attribute)
        return int(match.group(1)) if match else None

    @property
    def address_space(self) -> str | None:
        return next((word for word in self.type.split() if word in ADDRESS_SPACES), None)

    @property
    def c_type(self) -> str:
        """The type with Metal's address-space words removed."""
        return " ".join(word for word in self.type.split() if word not in ADDRESS_SPACES)


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple[Param, ...]
    body: str

    @property
    def buffers(self) -> tuple[Param, ...]:
        return tuple(sorted((p for p in self.params if p.buffer_index is not None), key=lambda p: p.buffer_index or 0))


@dataclass(frozen=True)
class FunctionConstant:
    index: int
    type: str
    name: str


@dataclass
class Source:
    kernels: dict[str, Kernel] = field(default_factory=dict)
    constants: dict[str, FunctionConstant] = field(default_factory=dict)
    structs: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    helpers: dict[str, str] = field(default_factory=dict)
    text: str = ""

    def reachable_text(self, kernel: str) -> str:
        """The kernel's body and the bodies of every helper it reaches."""
        seen: set[str] = set()
        pending = [self.kernels[kernel].body]
        parts = []
        while pending:
            body = pending.pop()
            parts.append(body)
            for name, helper in self.helpers.items():
                if name not in seen and re.search(rf"\b{name}\s*[(<]", body):
                    seen.add(name)
                    pending.append(helper)
        return "\n".join(parts)

    def uses_collectives(self, kernel: str) -> bool:
        return bool(COLLECTIVE_CALL.search(self.reachable_text(kernel)))

    def constants_used(self, kernel: str) -> set[str]:
        text = self.reachable_text(kernel)
        return {name for name in self.constants if re.search(rf"\b{name}\b", text)}


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _matching(text: str, start: int, open_char: str, close_char: str) -> int:
    """Index just past the bracket that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_char:
            depth += 1
        elif text[i] == close_char:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_char}{close_char} at offset {start}")


def _split_params(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char in "([<":
            depth += 1
        elif char in ")]>":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current))
    return [p.strip() for p in parts]


_PARAM = re.compile(r"^(?P<type>.+?[\s*&])(?P<name>\w+)\s*\[\[\s*(?P<attr>[^\]]+?)\s*\]\]$", re.S)


def parse(text: str) -> Source:
    clean = strip_comments(text)
    source = Source(text=text)
    for match in re.finditer(r"\bconstant\s+(\w+)\s+(\w+)\s*\[\[\s*function_constant\((\d+)\)\s*\]\]\s*;", clean):
        source.constants[match.group(2)] = FunctionConstant(int(match.group(3)), match.group(1), match.group(2))
    for match in re.finditer(r"\bstruct\s+(\w+)\s*\{([^}]*)\}\s*;", clean):
        fields = tuple((m.group(1), m.group(2)) for m in re.finditer(r"(\w+)\s+(\w+)\s*;", match.group(2)))
        source.structs[match.group(1)] = fields
    for match in re.finditer(r"\b(kernel\s+void|inline\s+[\w:<>\s*&]+?)\s+(\w+)\s*\(", clean):
        params_start = match.end() - 1
        params_end = _matching(clean, params_start, "(", ")")
        body_start = clean.index("{", params_end)
        body = clean[body_start : _matching(clean, body_start, "{", "}")]
        if match.group(1).startswith("kernel"):
            params = []
            for raw in _split_params(clean[params_start + 1 : params_end - 1]):
                parsed = _PARAM.match(raw)
                if parsed is None:
                    raise ValueError(f"kernel {match.group(2)}: cannot read argument {raw!r}")
                params.append(Param(" ".join(parsed.group("type").split()), parsed.group("name"), parsed.group("attr")))
            source.kernels[match.group(2)] = Kernel(match.group(2), tuple(params), body)
        else:
            source.helpers[match.group(2)] = body
    return source


def problems(source: Source) -> list[str]:
    """Constructs that g++ accepts but the Metal compiler rejects (or that would behave differently)."""
    found = []
    clean = strip_comments(source.text)
    for pattern, why in (
        (r"\bdouble\b", "Metal has no double"),
        (r"\bstd::", "no C++ standard library in MSL"),
        (r"\b(new|delete|throw|try|virtual|goto)\b", "not allowed in MSL"),
        (r"\bprintf\b", "no printf in kernels"),
        (r"\bstatic\s", "no static storage in MSL kernels"),
        (r"(?<![\w.])\d+\.\d*(?:[eE][-+]?\d+)?(?![fF\w.])", "float literal without f: double in C++, float in MSL"),
        (r"#include\s*[<\"](?!metal_)", "only Metal headers can be included"),
    ):
        for match in re.finditer(pattern, clean):
            line = clean.count("\n", 0, match.start()) + 1
            found.append(f"line {line}: {match.group(0)!r}: {why}")
    for kernel in source.kernels.values():
        indices = [p.buffer_index for p in kernel.buffers]
        if indices != list(range(len(indices))):
            found.append(f"{kernel.name}: buffer indices {indices} are not 0..{len(indices) - 1}")
        grid_types = set()
        for p in kernel.params:
            if p.buffer_index is not None:
                if ("*" in p.type or "&" in p.type) and p.address_space is None:
                    found.append(f"{kernel.name}: argument {p.name} has no address space")
            elif p.attribute in GRID_ATTRIBUTES:
                grid_types.add(p.type)
            elif p.attribute not in INDEX_ATTRIBUTES:
                found.append(f"{kernel.name}: unknown attribute [[{p.attribute}]] on {p.name}")
        scalar = {t for t in grid_types if t in ("uint", "ushort")}
        if len(grid_types) > 1 and (scalar or len({re.sub(r"\D", "", t) for t in grid_types}) > 1):
            found.append(f"{kernel.name}: grid position attributes mix types {sorted(grid_types)}")
    return found
