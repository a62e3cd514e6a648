"""What `pie tune` launches: each catalogue kernel at the shapes a decoder gives it.

A *site* is one use of a kernel in a Llama-family forward pass (the QKV
projection, the MLP's down projection, the LM head...) with its static operand's
shape; the tuner launches it at power-of-two row counts. Inputs are random
float32 host arrays, uploaded to the device before timing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pie.contract import PageLayout
from pie.model.config import ModelConfig
from pie.poem.lower import pow2_floor

CACHED_TOKENS = 256
"""Tokens already in the KV cache of each sequence when attention is timed."""
DECODE_ATTENTION = "attention_decode"
"""The attention site timed as a decode batch: ``rows`` sequences of one new token each. The plain
attention site is one sequence of ``rows`` new tokens. Both land in the same (size, rows) bucket,
and a variant replaces the default there only if it wins on both: a pass of ``rows`` tokens reaches
the bucket whether it is one prompt or a batch of decodes (a tune on an H200 once picked a variant
from the one-sequence timing alone that made decode at batch 2 and 4 about 10% slower)."""
PAGE_SIZE = 16


@dataclass(frozen=True)
class Dims:
    """The model dimensions the workload is built from."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    label: str = ""
    architecture: str = "llama"
    attention_bias: bool = False

    @classmethod
    def from_config(cls, config: ModelConfig, label: str = "") -> Dims:
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.vocab_size,
            label,
            config.architecture,
            config.attention_bias,
        )

    def config(self) -> ModelConfig:
        """A one-layer model of these dimensions: lowering it shows which kernels a plan launches."""
        return ModelConfig(
            architecture=self.architecture,
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_layers=1,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=None,
            tie_word_embeddings=False,
            attention_bias=self.attention_bias,
            max_position_embeddings=4096,
            bos_token_id=None,
            eos_token_ids=(),
        )

    def describe(self) -> str:
        text = (
            f"hidden {self.hidden}, intermediate {self.intermediate}, "
            f"heads {self.heads}/{self.kv_heads} x {self.head_dim}, "
            f"vocab {self.vocab}"
        )
        return f"{text} ({self.label})" if self.label else text


REFERENCE_DIMS = Dims(576, 1536, 9, 3, 64, 49152, "SmolLM2-135M, the default model")
GRID_WIDTHS = (256, 512, 1024, 2048, 4096)
"""Square weights swept by ``pie tune --full`` on top of the model's own shapes."""


@dataclass(frozen=True)
class Site:
    kernel: str
    label: str
    shape: tuple[int, ...]
    """The static operand: a weight ``[out, in]``, or one row of a weightless kernel's input."""
    max_rows: int = 1 << 20

    @property
    def size(self) -> int:
        return pow2_floor(math.prod(self.shape))


def sites(dims: Dims, grid: bool = False) -> list[Site]:
    """Every kernel use of a decoder layer and its head, plus square weights when ``grid``."""
    q, kv, d, f, v = (
        dims.heads * dims.head_dim,
        dims.kv_heads * dims.head_dim,
        dims.hidden,
        dims.intermediate,
        dims.vocab,
    )
    sampled = 64  # the LM head, argmax and softmax see one row per sequence, not per token
    qkv, o, gate_up, down, head = (q + 2 * kv, d), (d, q), (2 * f, d), (d, f), (v, d)
    found = [
        Site("embedding", "embed", (v, d)),
        Site("rms_norm", "norm", (d,)),
        Site("add", "residual", (d,)),
        Site("slice_columns", "qkv_split", (q + 2 * kv,)),
        Site("rope", "rope_q", (q,)),
        Site("append_kv", "append_kv", (kv,), max_rows=1024),
        Site("attention", "attention", (q,), max_rows=1024),
        Site("attention", DECODE_ATTENTION, (q,), max_rows=256),
        Site("silu_mul", "silu_mul", (2 * f,)),
        Site("gather_rows", "gather", (d,)),
        Site("argmax", "argmax", (v,), max_rows=sampled),
        Site("epilogue", "logit_softcap", (v,), max_rows=sampled),
        Site("softmax", "softmax", (v,), max_rows=sampled),
        Site("linear", "qkv", qkv),
        Site("linear", "o", o),
        Site("linear", "gate_up", gate_up),
        Site("linear", "down", down),
        Site("linear", "lm_head", head, max_rows=sampled),
        Site("rms_norm_linear", "qkv", qkv),
        Site("rms_norm_linear", "lm_head", head, max_rows=sampled),
        Site("linear_add", "o", o),
        Site("linear_add", "down", down),
        Site("rms_norm_gate_up_silu", "gate_up", gate_up),
    ]
    if grid:
        for width in GRID_WIDTHS:
            square = (width, width)
            for kernel in ("linear", "rms_norm_linear", "linear_add", "rms_norm_gate_up_silu"):
                found.append(Site(kernel, f"square{width}", square))
    return found


@dataclass
class Launch:
    """One kernel launch's host inputs and compile options; ``layout`` is set for page-pool kernels,
    whose ``None`` first (append_kv: second) pool argument the tuner fills with a device pool."""

    args: list[np.ndarray | None]
    options: dict[str, Any]
    layout: PageLayout | None = None
    pool_index: int = -1


def launch_inputs(site: Site, rows: int, dims: Dims, rng: np.random.Generator) -> Launch:
    """Random inputs for ``site`` at ``rows`` rows."""

    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    kernel, shape = site.kernel, site.shape
    eps = {"eps": 1e-5}
    if kernel == "linear":
        return Launch([f32(rows, shape[1]), f32(*shape) * 0.05, None], {})
    if kernel == "rms_norm_linear":
        return Launch([f32(rows, shape[1]), f32(shape[1]), f32(*shape) * 0.05, None], eps)
    if kernel == "linear_add":
        return Launch([f32(rows, shape[1]), f32(*shape) * 0.05, f32(rows, shape[0])], {})
    if kernel == "rms_norm_gate_up_silu":
        return Launch([f32(rows, shape[1]), f32(shape[1]), f32(*shape) * 0.05], eps)
    if kernel == "embedding":
        return Launch([rng.integers(0, shape[0], rows).astype(np.int32), f32(*shape)], {})
    width = shape[0]
    if kernel == "rms_norm":
        return Launch([f32(rows, width), f32(width)], eps)
    if kernel == "add":
        return Launch([f32(rows, width), f32(rows, width)], {})
    if kernel == "slice_columns":
        return Launch([f32(rows, width)], {"start": 0, "stop": width // 2})
    if kernel == "rope":
        inv_freq = (1.0 / 10000 ** (np.arange(0, dims.head_dim, 2) / dims.head_dim)).astype(np.float32)
        positions = np.arange(CACHED_TOKENS, CACHED_TOKENS + rows, dtype=np.int32)
        return Launch([f32(rows, width), positions, inv_freq], {"head_dim": dims.head_dim})
    if kernel == "silu_mul":
        return Launch([f32(rows, width)], {})
    if kernel == "gather_rows":
        return Launch([f32(rows, width), np.arange(rows, dtype=np.int32)], {})
    if kernel == "argmax":
        return Launch([f32(rows, width)], {})
    if kernel == "epilogue":
        from pie.eta.stdlib import SOURCES

        return Launch([f32(rows, width)], {"source": SOURCES["logit_softcap"], "params": (("cap", 30.0),)})
    if kernel == "softmax":
        return Launch([f32(rows, width)], {"temperature": 0.8})
    if site.label == DECODE_ATTENTION:
        return _attention_launch(rows, 1, dims, f32)
    if kernel == "attention":
        return _attention_launch(1, rows, dims, f32)
    if kernel == "append_kv":
        return _append_launch(rows, dims, f32)
    raise KeyError(f"no workload for kernel {kernel!r}")


def _append_launch(rows: int, dims: Dims, f32: Any) -> Launch:
    """One sequence: ``rows`` new tokens appended after :data:`CACHED_TOKENS` cached ones."""
    total = CACHED_TOKENS + rows
    layout = PageLayout(1, -(-total // PAGE_SIZE), PAGE_SIZE, dims.kv_heads, dims.head_dim)
    kv = dims.kv_heads * dims.head_dim
    slots = np.arange(CACHED_TOKENS, total, dtype=np.int32)
    return Launch([None, f32(rows, kv), f32(rows, kv), slots], {"layer": 0}, layout, 0)


def _attention_launch(sequences: int, new_tokens: int, dims: Dims, f32: Any) -> Launch:
    """``sequences`` sequences, each ``new_tokens`` new tokens after :data:`CACHED_TOKENS` cached ones."""
    total = CACHED_TOKENS + new_tokens
    per_sequence = -(-total // PAGE_SIZE)
    pages = sequences * per_sequence
    layout = PageLayout(1, pages, PAGE_SIZE, dims.kv_heads, dims.head_dim)
    batch = [
        np.arange(0, sequences * new_tokens + 1, new_tokens, dtype=np.int32),
        np.arange(pages, dtype=np.int32),
        np.arange(0, pages + 1, per_sequence, dtype=np.int32),
        np.full(sequences, total - (per_sequence - 1) * PAGE_SIZE, np.int32),
    ]
    options = {"layer": 0, "num_heads": dims.heads, "scale": float(dims.head_dim) ** -0.5}
    return Launch([f32(sequences * new_tokens, dims.heads * dims.head_dim), None, *batch], options, layout, 1)
