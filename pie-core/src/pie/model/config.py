"""The shape of a decoder model, independent of the file it came from (its architecture: `pie.models`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np

INT32_MAX = 2**31 - 1
"""The largest size, token id or position a config may claim: the runtime and the kernels index with int32."""


class InvalidConfig(ValueError):
    """A config value out of range, or two values that disagree.

    The message is built by `describe` from a function that spells a `ModelConfig` field name, so
    each loader can say it in its file's own names (`num_hidden_layers` in config.json,
    `llama.block_count` in a GGUF file) through `naming`.
    """

    def __init__(self, describe: Callable[[Callable[[str], str]], str]) -> None:
        self._describe = describe
        super().__init__(describe(repr))

    def naming(self, names: Mapping[str, str]) -> str:
        """The message with each field spelled as `names` says (fields not in it keep their own name)."""
        return self._describe(lambda field: repr(names.get(field, field)))


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent rope scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder, common to every architecture (`pie.models`), with the fields only
    some architectures set defaulting to a plain Llama layer.

    Rotary embeddings use the Hugging Face "rotate_half" (GPT-NeoX) layout: a head's first half
    of dimensions pairs with its second half. `attention_bias` means biased Q, K and V
    projections (always so for Qwen2); Llama's and Qwen3's bias the output projection too.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Per-frequency divisors some GGUF files carry as a `rope_freqs` tensor (llama.cpp's form of
    # Llama 3.1 scaling); applied after `rope_scaling`.
    rope_freq_factors: tuple[float, ...] | None = None
    # What some architectures add (see pie.models); the defaults mean a plain Llama layer.
    layer_windows: tuple[int, ...] = ()
    """Each layer's sliding attention window (0: global attention); empty: every layer global."""
    rope_local_theta: float | None = None
    """The rope base of sliding-window layers where it differs from ``rope_theta`` (Gemma 3)."""
    attn_softcap: float = 0.0
    """Attention scores soft-capped to ``(-cap, cap)``; 0: not capped (Gemma 2)."""
    final_softcap: float = 0.0
    """Logits soft-capped to ``(-cap, cap)``; 0: not capped (Gemma 2)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores scale by this to the power -1/2 instead of ``head_dim``'s (Gemma)."""

    def __post_init__(self) -> None:
        from pie.models import ARCHITECTURES

        known = tuple(ARCHITECTURES)
        if self.architecture not in known:
            raise InvalidConfig(lambda n: f"{n('architecture')} is {self.architecture!r}, not one of {known}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            check_size(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise InvalidConfig(lambda n: f"{n('num_heads')} ({self.num_heads}) is not a multiple of "
                                          f"{n('num_kv_heads')} ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise InvalidConfig(lambda n: f"{n('head_dim')} must be even for rotary embeddings, got {self.head_dim}")
        _check_positive_number("rms_norm_eps", self.rms_norm_eps)
        _check_positive_number("rope_theta", self.rope_theta)
        factors = self.rope_freq_factors
        if factors is not None and len(factors) != self.head_dim // 2:
            raise InvalidConfig(lambda n: f"{n('rope_freq_factors')} has {len(factors)} entries, "
                                          f"expected {self.head_dim // 2}")
        if factors is not None and not all(math.isfinite(f) and f > 0 for f in factors):
            raise InvalidConfig(lambda n: f"{n('rope_freq_factors')} holds a value that is not a positive number")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise InvalidConfig(lambda n: f"{n('layer_windows')} has {len(self.layer_windows)} entries for "
                                          f"{self.num_layers} layers")
        if any(isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= INT32_MAX for w in self.layer_windows):
            raise InvalidConfig(lambda n: f"{n('layer_windows')} holds {self.layer_windows}, not window sizes")
        for name in ("rope_local_theta", "query_pre_attn_scalar"):
            if getattr(self, name) is not None:
                _check_positive_number(name, getattr(self, name))
        for name in ("attn_softcap", "final_softcap"):
            if getattr(self, name):
                _check_positive_number(name, getattr(self, name))
        refusal = ARCHITECTURES[self.architecture].check(self)
        if refusal is not None:
            raise InvalidConfig(lambda n: refusal)
        if self.bos_token_id is not None:
            _check_token_ids("bos_token_id", (self.bos_token_id,), self.vocab_size)
        _check_token_ids("eos_token_ids", self.eos_token_ids, self.vocab_size)

    def rope_inv_freq(self, theta: float | None = None) -> np.ndarray:
        """Inverse rotary frequencies, float32 `[head_dim // 2]`, computed as transformers does, for the
        base ``theta`` (default ``rope_theta``)."""
        dim = self.head_dim
        # float32 exponents, the power taken in float64 and rounded: bit-for-bit what torch does.
        exponent = (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)
        base = np.float64(self.rope_theta if theta is None else theta)
        inv_freq: np.ndarray = np.float32(1.0) / (base**exponent).astype(np.float32)
        scaling = self.rope_scaling
        if scaling is not None:
            old_context = scaling.original_max_position_embeddings
            low_freq_wavelen = old_context / scaling.low_freq_factor
            high_freq_wavelen = old_context / scaling.high_freq_factor
            # torch computes `scalar / tensor` as `reciprocal(tensor) * scalar`; so do we, to match bits.
            wavelen = (np.float32(1) / inv_freq) * np.float32(2 * math.pi)
            scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(scaling.factor), inv_freq)
            smooth = ((np.float32(1) / wavelen) * np.float32(old_context) - np.float32(scaling.low_freq_factor)) / (
                np.float32(scaling.high_freq_factor - scaling.low_freq_factor))
            smoothed = (1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            inv_freq = np.where(is_medium, smoothed, scaled)
        if self.rope_freq_factors is not None:
            inv_freq = inv_freq / np.asarray(self.rope_freq_factors, dtype=np.float32)
        return np.ascontiguousarray(inv_freq, dtype=np.float32)


def check_size(name: str, value: object) -> None:
    """Refuse a size, count or length (the `ModelConfig` field ``name``) outside 1 to `INT32_MAX`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= INT32_MAX:
        raise InvalidConfig(lambda n: f"{n(name)} must be an integer from 1 to {INT32_MAX}, got {value!r}")


def _check_positive_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidConfig(lambda n: f"{n(name)} must be a positive number, got {value!r}")


def _check_token_ids(name: str, ids: tuple[int, ...], vocab_size: int) -> None:
    outside = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size]
    if outside:
        raise InvalidConfig(lambda n: f"{n(name)} is {outside[0]!r}, outside the vocabulary of {vocab_size} tokens")


def default_head_dim(hidden_size: int, num_heads: int) -> int:
    """The head size of a file that states none: `hidden_size / num_heads`, which must divide evenly."""
    check_size("hidden_size", hidden_size)
    check_size("num_heads", num_heads)
    if hidden_size % num_heads:
        raise InvalidConfig(lambda n: f"{n('hidden_size')} ({hidden_size}) is not a multiple of {n('num_heads')} "
                                      f"({num_heads}), and no {n('head_dim')} is given")
    return hidden_size // num_heads


def check_layer_indices(num_layers: int, indices: Collection[int]) -> None:
    """Refuse a layer count that the weights present do not back, before anything is built per layer.

    `indices` are the distinct layer numbers found in the file's tensor names.
    """
    check_size("num_layers", num_layers)
    if len(indices) != num_layers:
        raise InvalidConfig(lambda n: f"{n('num_layers')} is {num_layers}, but the file holds tensors "
                                      f"for {len(indices)} layers")
    if indices and (min(indices) != 0 or max(indices) != num_layers - 1):
        raise InvalidConfig(lambda n: f"{n('num_layers')} is {num_layers}, but the file's layers are numbered "
                                      f"{min(indices)} to {max(indices)}")


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model needs, by Hugging Face name, in load order, with its shape (matrices
    ``[out_features, in_features]``): what its architecture (`pie.models`) says."""
    from pie.models import architecture_of

    return architecture_of(config).weight_shapes(config)
