"""Rendering: deterministic output, hashes, binding layouts and hygiene of user text."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap

import pie.eta as eta
import pytest
from pie.eta import TARGETS, stdlib
from pie.eta.checker import MAX_REDUCTIONS
from pie.eta.lexer import MAX_SOURCE_LENGTH

RMS = stdlib.SOURCES["rms_norm"]


@pytest.mark.parametrize("target", TARGETS)
def test_rendering_is_byte_identical_and_hashed(target: str) -> None:
    first, second = eta.compile(RMS).render(target), eta.compile(RMS).render(target)
    assert first == second
    assert first.sha256 == hashlib.sha256(first.source.encode()).hexdigest()
    assert first.target == target and first.entry_point in first.source


def test_hashes_are_stable_across_processes() -> None:
    """No hash randomisation or set order may leak into the source."""
    script = textwrap.dedent(
        """
        import pie.eta as eta
        from pie.eta import stdlib
        eps = [stdlib.get(name) for name in stdlib.SOURCES]
        print(" ".join(eta.render_many(eps, t)[0].sha256 for t in eta.TARGETS))
        """
    )
    hashes = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        hashes.add(
            subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
        )
    assert len(hashes) == 1


def test_equivalent_spellings_share_a_key_and_entry_point() -> None:
    a = eta.compile("in x: f32\nparam t: f32\nout y = x / t  # temperature")
    b = eta.compile("in x:f32;param t:f32;let q=x/t;out y=(q)")
    assert a.key == b.key and a.entry_point == b.entry_point
    assert a.render("cuda").source == b.render("cuda").source
    assert eta.compile("in x: f32; param t: f32; out y = t / x").key != a.key


def test_ir_text_is_canonical() -> None:
    assert eta.compile("in x: f32; param t: f32; out y = x / t").ir_text == (
        "in x: f32[rows,cols]\nparam t: f32\n%0 = load.f32 x[rows,cols]\n%1 = paramref.f32 t\n"
        "%2 = op.f32 div %0 %1\nout y: f32 = %2\n"
    )


def test_render_many_shares_one_module_and_deduplicates() -> None:
    eps = [stdlib.get("softmax"), stdlib.get("silu_mul"), stdlib.get("softmax")]
    kernels = eta.render_many(eps, "wgsl")
    assert len({k.source for k in kernels}) == 1 and len({k.sha256 for k in kernels}) == 1
    assert [k.entry_point for k in kernels] == [ep.entry_point for ep in eps]
    assert kernels[0].source.count(f"fn {eps[0].entry_point}(") == 1


def test_unknown_target() -> None:
    with pytest.raises(ValueError, match="unknown target 'ptx'"):
        stdlib.get("softmax").render("ptx")


def test_binding_layout() -> None:
    ep = eta.compile(
        "in x: f32; in b: f32[cols]; param t: f16; param n: i32; param on: bool; out y = x + b; out z: i32 = n"
    )
    layout = ep.render("metal").bindings
    assert [(b.slot, b.name, b.role, b.dtype.value, b.shape) for b in layout.buffers] == [
        (0, "x", "input", "f32", "rows,cols"),
        (1, "b", "input", "f32", "cols"),
        (2, "y", "output", "f32", "rows,cols"),
        (3, "z", "output", "i32", "rows,cols"),
    ]
    assert [(f.name, f.storage, f.offset) for f in layout.fields] == [
        ("rows", "u32", 0),
        ("cols", "u32", 4),
        ("t", "f32", 8),
        ("n", "i32", 12),
        ("on", "u32", 16),
    ]
    assert (layout.params_slot, layout.params_size, layout.workgroup_size, layout.per_row) == (4, 32, 256, False)
    packed = layout.pack_params(3, 5, t=0.5, n=-2, on=True)
    assert packed == bytes.fromhex("03000000050000000000003ffeffffff01000000") + bytes(12)
    with pytest.raises(TypeError):
        layout.pack_params(3, 5, t=0.5)
    # Every target binds the same way.
    assert all(ep.render(t).bindings == layout for t in TARGETS)


def test_a_param_may_have_any_eta_name() -> None:
    """The sizes are positional-only: a param named `self` (or `rows`' neighbours) packs like any other."""
    layout = eta.compile("in x: f32; param self: f32; param cols2: i32; out y = x * self").render("wgsl").bindings
    assert layout.pack_params(1, 2, self=2.0, cols2=3) == bytes.fromhex("01000000020000000000004003000000")


def test_grid_shape() -> None:
    elementwise = stdlib.get("silu_mul").render("wgsl").bindings
    per_row = stdlib.get("softmax").render("wgsl").bindings
    assert (elementwise.per_row, per_row.per_row) == (False, True)
    assert elementwise.groups(3, 100) == (2, 1)
    assert elementwise.groups(0, 100) == (1, 1)
    assert elementwise.groups(65536, 512) == (65535, 3)  # 131072 groups: past WebGPU's 65535 per dimension
    assert per_row.groups(70000, 8) == (65535, 2)
    with pytest.raises(ValueError):
        elementwise.pack_params(2**16, 2**15)


NAMES = ("Gate7", "Up_x2", "Tq9")


@pytest.mark.parametrize("target", TARGETS)
def test_user_text_reaches_the_source_only_mangled(target: str) -> None:
    source = f"""
    # EvilComment */ }} {{ #include <stdio.h>
    in {NAMES[0]}: f32
    in {NAMES[1]}: f32[cols]
    param {NAMES[2]}: f32
    out Out1 = {NAMES[0]} * 00001.500000 + {NAMES[1]} / {NAMES[2]} + 0017 * 2.50e-0
    """
    text = eta.compile(textwrap.dedent(source)).render(target).source
    for name in (*NAMES, "Out1"):
        stripped = re.sub(rf"\b(?:\w+_)?(?:in|out|p)_{name}\b", "", text)
        assert name not in stripped
    for spelled in ("EvilComment", "00001.5", "0017", "2.50e"):
        assert spelled not in text
    assert re.search(r"\b1\.5f?\b", text) and re.search(r"\b17\b", text) and re.search(r"\b2\.5f?\b", text)


@pytest.mark.parametrize("target", TARGETS)
def test_f32s_largest_literals_render(target: str) -> None:
    """A shorter rounding of a value near f32's largest lies past it (3.403e+38): that digit count is no match."""
    text = eta.compile("in x: f32; out y = min(x, 3.4028235e38) + 3.4028e38 - 340282346638528859811704183484516925440")
    source = text.render(target).source
    assert "3.4028235e+38" in source and "3.4028e+38" in source


def test_the_largest_accepted_program_renders_to_a_bounded_size() -> None:
    """Every row reduction recomputes what it reduces: at most MAX_REDUCTIONS + 1 passes over a program of at
    most one IR node per two characters of source, however they are chained."""
    reductions = "".join(f" + row_max(a + {k}.0)" for k in range(MAX_REDUCTIONS))
    head, tail = "in x: f32; let a = x", f"; out y = a{reductions}"
    source = head + "*x" * ((MAX_SOURCE_LENGTH - len(head) - len(tail)) // 2) + tail
    rendered = eta.compile(source).render("cuda").source
    assert f"rd{MAX_REDUCTIONS - 1} = " in rendered and f"rd{MAX_REDUCTIONS} = " not in rendered
    assert len(rendered) < 16 * 2**20  # 86 MB when passes recomputed the reductions before them, unbounded
