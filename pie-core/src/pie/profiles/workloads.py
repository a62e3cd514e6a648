"""What `pie tune` launches: each catalogue kernel at the shapes a decoder gives it.

A *site* is one use of a kernel in a model's forward pass (the QKV projection, the
MLP's down projection, the LM head...) with its static operand's shape, read off the
graph its architecture builds; the tuner launches it at power-of-two row counts. Inputs are random
float32 host arrays, uploaded to the device before timing. Attention is also timed over a long
context, so a profile can choose its variant per KV length (``min_kv_tokens``).
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
"""Tokens already in the KV cache of each sequence when attention is timed; its buckets name no KV
length, so they hold below the long-context ones."""
LONG_CACHED_TOKENS = 4096
"""Tokens already cached in each sequence of the long-context attention sites, whose buckets hold from
this many keys on (``min_kv_tokens``): enough that split-KV attention has several chunks to spread."""
LONG_CONTEXT_ROWS = 64
"""The long-context attention sites are timed up to this many rows: decode batches and short prompt
chunks, where a variant may win by spreading one sequence's keys; larger passes fill a device anyway."""
DECODE_ATTENTION = "attention_decode"
"""The attention site timed as a decode batch (its label, or the start of the long-context one's):
``rows`` sequences of one new token each. The plain attention site is one sequence of ``rows`` new
tokens. Both land in the same (size, rows) bucket, and a variant replaces the default there only if
it wins on both: a pass of ``rows`` tokens reaches the bucket whether it is one prompt or a batch of
decodes (a tune once picked a variant from the one-sequence timing alone that made small decode batches
slower)."""
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
    options: tuple[tuple[str, Any], ...] = ()
    """The compile options of the graph's op (an attention's window, an epilogue's source)."""
    cached_tokens: int = CACHED_TOKENS
    """Tokens already in each sequence's KV cache (attention)."""

    @property
    def size(self) -> int:
        return pow2_floor(math.prod(self.shape))

    @property
    def min_kv_tokens(self) -> int:
        """The KV threshold of the buckets it informs: 0 (none) at :data:`CACHED_TOKENS`, else the
        power-of-two anchor of its cached length (every pass it times reads at least that many keys)."""
        return 0 if self.cached_tokens == CACHED_TOKENS else pow2_floor(self.cached_tokens)


SAMPLED_ROWS = 64
"""Rows of the sites after the LM head's row gather: one per sequence, not per token."""
SAMPLING_SITES = (
    Site("argmax", "argmax", (), max_rows=SAMPLED_ROWS),
    Site("softmax", "softmax", (), max_rows=SAMPLED_ROWS),
    Site("epilogue", "logit_softcap", (), max_rows=SAMPLED_ROWS),
)
"""Kernels the sampler launches on the logits (shape ``(vocab,)`` filled in by `sites`)."""


def sites(dims: Dims, grid: bool = False) -> list[Site]:
    """Every kernel use of the forward pass of a one-layer model of ``dims`` (its architecture's graph,
    `pie.models`) and the sampler's, each distinct kernel and shape once, plus square weights when ``grid``."""
    from pie.models import architecture_of
    from pie.poem import build_decoder_graph, partition
    from pie.poem.lower import FUSIONS

    config = dims.config()
    graph = build_decoder_graph(config)
    weights = architecture_of(config).poem_weight_shapes(config)
    widths: dict[str, int] = {}
    found: dict[tuple[str, tuple[int, ...], str], Site] = {}

    def add(site: Site) -> None:
        # Attention is timed four times per shape (prompt and decode batch, short and long context).
        found.setdefault((site.kernel, site.shape, site.label if site.kernel == "attention" else ""), site)

    sampled: set[str] = set()
    for op in graph.ops:
        first = op.inputs[0]
        after_gather = op.kind == "gather_rows" or any(name in sampled for name in op.inputs if name)
        if after_gather and op.output:
            sampled.add(op.output)
        max_rows = SAMPLED_ROWS if after_gather and op.kind != "gather_rows" else 1 << 20
        if op.kind in ("linear", "embedding"):
            weight = op.inputs[1] or ""
            shape = weights[weight]
            add(Site(op.kind, _weight_label(weight), shape, max_rows))
            widths[op.output or ""] = shape[0] if op.kind == "linear" else shape[1]
            continue
        width = widths[first or ""] if op.kind != "append_kv" else widths[op.inputs[1] or ""]
        options = op.options if op.kind in ("attention", "epilogue", "rms_norm_heads") else ()
        label = _value_label(op.output or f"{op.kind}")
        if op.kind == "attention":
            long = f"_kv{LONG_CACHED_TOKENS}"
            add(Site("attention", "attention", (width,), 1024, options))
            add(Site("attention", DECODE_ATTENTION, (width,), 256, options))
            add(Site("attention", "attention" + long, (width,), LONG_CONTEXT_ROWS, options, LONG_CACHED_TOKENS))
            add(Site("attention", DECODE_ATTENTION + long, (width,), LONG_CONTEXT_ROWS, options, LONG_CACHED_TOKENS))
        else:
            add(Site(op.kind, label, (width,), 1024 if op.kind == "append_kv" else max_rows, options))
        if op.output:
            widths[op.output] = width // 2 if op.kind == "silu_mul" else width
            if op.kind == "slice_columns":
                widths[op.output] = int(op.option_dict["stop"]) - int(op.option_dict["start"])
    uses = graph.use_counts()
    for region in partition(graph):
        for start in range(len(region.ops)):
            for fusion in FUSIONS:
                window = region.ops[start : start + len(fusion.kinds)]
                if fusion.matches(window, uses):
                    projection = next(op for op in window if op.kind == "linear")
                    weight = projection.inputs[1] or ""
                    head = weight == "w.lm_head"
                    add(Site(fusion.kernel, _weight_label(weight), weights[weight], SAMPLED_ROWS if head else 1 << 20))
    for site in SAMPLING_SITES:
        add(Site(site.kernel, site.label, (dims.vocab,), site.max_rows))
    if grid:
        for width in GRID_WIDTHS:
            square = (width, width)
            for kernel in ("linear", "rms_norm_linear", "linear_add", "rms_norm_gate_up_silu"):
                add(Site(kernel, f"square{width}", square))
    return list(found.values())


def _weight_label(weight: str) -> str:
    """``w.L0.qkv`` -> ``qkv``, ``w.lm_head`` -> ``lm_head``, ``w.embed`` -> ``embed``."""
    return weight.split(".")[-1]


def _value_label(value: str) -> str:
    """``L0.q_rot`` -> ``q_rot``, ``head.rows`` -> ``rows``."""
    return value.split(".", 1)[-1]


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
    if kernel == "epilogue" and site.options:
        from pie import eta

        options = dict(site.options)
        return Launch([f32(rows, width) for _ in eta.compile(options["source"]).inputs], options)
    if kernel == "epilogue":
        from pie.eta.stdlib import SOURCES

        return Launch([f32(rows, width)], {"source": SOURCES["logit_softcap"], "params": (("cap", 30.0),)})
    if kernel == "rms_norm_heads":
        return Launch([f32(rows, width), f32(dims.head_dim)], dict(site.options))
    if kernel == "softmax":
        return Launch([f32(rows, width)], {"temperature": 0.8})
    if kernel == "attention" and site.label.startswith(DECODE_ATTENTION):
        return _attention_launch(rows, 1, site.cached_tokens, dims, f32, site.options)
    if kernel == "attention":
        return _attention_launch(1, rows, site.cached_tokens, dims, f32, site.options)
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


def _attention_launch(
    sequences: int, new_tokens: int, cached: int, dims: Dims, f32: Any, options: tuple[tuple[str, Any], ...] = ()
) -> Launch:
    """``sequences`` sequences, each ``new_tokens`` new tokens after ``cached`` cached ones."""
    total = cached + new_tokens
    per_sequence = -(-total // PAGE_SIZE)
    pages = sequences * per_sequence
    layout = PageLayout(1, pages, PAGE_SIZE, dims.kv_heads, dims.head_dim)
    batch = [
        np.arange(0, sequences * new_tokens + 1, new_tokens, dtype=np.int32),
        np.arange(pages, dtype=np.int32),
        np.arange(0, pages + 1, per_sequence, dtype=np.int32),
        np.full(sequences, total - (per_sequence - 1) * PAGE_SIZE, np.int32),
    ]
    compile_options = {"layer": 0, "num_heads": dims.heads, "scale": float(dims.head_dim) ** -0.5, **dict(options)}
    return Launch([f32(sequences * new_tokens, dims.heads * dims.head_dim), None, *batch], compile_options, layout, 1)
