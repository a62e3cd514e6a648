"""Rebuilding a tokenizer from the vocabulary a GGUF file stores in its metadata.

A GGUF file has no tokenizer.json, only llama.cpp's description of one: the model kind
(`tokenizer.ggml.model`), the pre-tokenizer's name (`tokenizer.ggml.pre`), tokens, merges,
scores and token types. We assemble the equivalent `tokenizers.Tokenizer` from those parts,
splitting text the way llama.cpp does for each named pre-tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as Backend

from .chat_template import check_renders
from .errors import ChatTemplateError, ModelLoadError, is_library_error
from .gguf_metadata import GGUFMetadata
from .tokenizer import Tokenizer, check_encodes

# llama.cpp token types (llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# `tokenizer.ggml.pre` -> how llama.cpp splits text before byte-level BPE.
_BYTE_LEVEL_PRE_TOKENIZERS = {
    "default": _gpt2_split,  # also what a file without the key gets
    "gpt-2": _gpt2_split,
    "smollm": _smollm_split,
    "llama-bpe": lambda: _regex_split(_LLAMA3_SPLIT),
    "llama3": lambda: _regex_split(_LLAMA3_SPLIT),
    "qwen2": lambda: _regex_split(_QWEN2_SPLIT),
}
# Llama 3's vocabulary: whole words found in it skip the merges, and BOS is added unless the file says not.
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3"})


def tokenizer_from_gguf(meta: GGUFMetadata) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model", str)
    pre = meta.get("tokenizer.ggml.pre", str, "default")
    tokens = _typed_list(meta, "tokenizer.ggml.tokens", str)
    types = _per_token(meta, "tokenizer.ggml.token_type", int, tokens, [_NORMAL] * len(tokens))
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens, pre)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types)
    else:
        raise ModelLoadError(f"{meta.path}: unsupported tokenizer model {kind!r} (tokenizer.ggml.model); "
                             "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token, type_ in zip(tokens, types) if type_ in (_CONTROL, _UNKNOWN)])
    backend.add_tokens([AddedToken(token, special=False, normalized=False)
                        for token, type_ in zip(tokens, types) if type_ == _USER_DEFINED])

    def token_id(key: str) -> int | None:
        value = meta.get(key, int, None)
        if value is not None and not 0 <= value < len(tokens):
            raise ModelLoadError(f"{meta.path}: metadata key {key!r} is {value}, outside the vocabulary")
        return value

    bos = token_id("tokenizer.ggml.bos_token_id")
    eos = [token_id(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
    add_bos = meta.get("tokenizer.ggml.add_bos_token", bool, kind == "llama" or pre in _LLAMA3_PRE)
    add_eos = meta.get("tokenizer.ggml.add_eos_token", bool, False)
    _set_post_processor(backend, tokens, bos if add_bos else None, eos_ids[0] if add_eos and eos_ids else None)
    check_encodes(backend, f"{meta.path}: metadata keys 'tokenizer.ggml.*'")
    try:
        tokenizer = Tokenizer(backend, bos_token_id=bos, eos_token_ids=eos_ids,
                              chat_template=meta.get("tokenizer.chat_template", str, None))
        if tokenizer.chat_template is not None:
            check_renders(tokenizer.apply_chat_template)
        return tokenizer
    except ChatTemplateError as exc:
        raise ModelLoadError(f"{meta.path}: metadata key 'tokenizer.chat_template': {exc}") from exc


def _byte_level_bpe(meta: GGUFMetadata, tokens: list[str], pre: str) -> Backend:
    if pre not in _BYTE_LEVEL_PRE_TOKENIZERS:
        raise ModelLoadError(f"{meta.path}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                             f"supported: {sorted(_BYTE_LEVEL_PRE_TOKENIZERS)}")
    merges = _parse_merges(meta, _typed_list(meta, "tokenizer.ggml.merges", str))
    backend = _bpe(meta, lambda: models.BPE(_vocab(tokens), merges, ignore_merges=pre in _LLAMA3_PRE))
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _BYTE_LEVEL_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: GGUFMetadata, tokens: list[str], types: list[int]) -> Backend:
    if "tokenizer.ggml.merges" in meta:
        merges = _parse_merges(meta, _typed_list(meta, "tokenizer.ggml.merges", str))
    else:
        scores = _per_token(meta, "tokenizer.ggml.scores", (int, float), tokens)
        merges = _merges_from_scores(meta, tokens, scores, types)
    unk = meta.get("tokenizer.ggml.unknown_token_id", int, None)
    unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    backend = _bpe(meta, lambda: models.BPE(_vocab(tokens), merges, unk_token=unk_token, fuse_unk=True,
                                            byte_fallback=True))
    add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", bool, True)
    spaces = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if add_space_prefix else spaces
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    return backend


_MISSING: Any = object()


def _typed_list(meta: GGUFMetadata, key: str, item: type | tuple[type, ...], default: Any = _MISSING) -> list[Any]:
    """The array of ``key`` (``default`` when absent and given), each entry of type ``item`` (a bool is no number);
    a ModelLoadError naming the key and the first entry that is not."""
    values = meta.get(key, list) if default is _MISSING else meta.get(key, list, default)
    for index, value in enumerate(values):
        if not isinstance(value, item) or isinstance(value, bool):
            expected = "text" if item is str else "an integer" if item is int else "a number"
            raise ModelLoadError(f"{meta.path}: metadata key {key!r} entry {index} is {value!r}, not {expected}")
    return values


def _per_token(meta: GGUFMetadata, key: str, item: type | tuple[type, ...], tokens: list[str],
               default: Any = _MISSING) -> list[Any]:
    """`_typed_list` of an array with an entry per token, its length checked before its entries are read."""
    count = meta.count(key)
    if count is not None and count != len(tokens):
        raise ModelLoadError(f"{meta.path}: metadata key {key!r} has {count} entries for {len(tokens)} tokens")
    return _typed_list(meta, key, item, default)


def _bpe(meta: GGUFMetadata, make: Callable[[], models.BPE]) -> Backend:
    """A tokenizer of the BPE model ``make`` builds, or a ModelLoadError with the library's reason (a merge of
    tokens outside the vocabulary)."""
    try:
        return Backend(make())
    except BaseException as exc:  # tokenizers raises a bare Exception for a vocabulary and merges that disagree, and
        if not is_library_error(exc):  # panics for a merge whose result the vocabulary lacks
            raise
        raise ModelLoadError(f"{meta.path}: the vocabulary and merges (tokenizer.ggml.tokens, tokenizer.ggml.merges) "
                             f"do not make a tokenizer: {exc}") from None


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # keep the first of duplicated spellings
    return vocab


def _parse_merges(meta: GGUFMetadata, merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if not all(len(pair) == 2 for pair in pairs):
        index = next(i for i, pair in enumerate(pairs) if len(pair) != 2)
        raise ModelLoadError(f"{meta.path}: metadata key 'tokenizer.ggml.merges' entry {index} "
                             f"({merges[index]!r}) is not two tokens separated by a space")
    return pairs  # type: ignore[return-value]


MAX_MERGED_CHARS = 256
"""The longest normal token of a file without merges whose merges are derived: each of its cuts is looked up, at a
cost of its length (SentencePiece makes pieces of at most 16 characters unless told otherwise). A longer one gets no
merge that makes it: it stays in the vocabulary, and text is never merged into it."""
MAX_MERGES_PER_TOKEN = 32
"""The most merges derived per token of a file without merges, on average: every cut of a token into two tokens is
one, so a real vocabulary (pieces of at most 16 characters) makes fewer than 16, while a vocabulary of every short
string would make one per character of the file."""


def _merges_from_scores(meta: GGUFMetadata, tokens: list[str], scores: list[float],
                        types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE files list no merges: every split of a token into two vocabulary
    tokens is a merge, ranked by the merged token's score (higher merges first)."""
    ids = _vocab(tokens)
    limit = MAX_MERGES_PER_TOKEN * len(tokens)
    found: list[int] = []  # (merged, left, right) ids, one after another
    for merged, (token, kind) in enumerate(zip(tokens, types)):
        if kind != _NORMAL:
            continue
        if len(token) > MAX_MERGED_CHARS:
            continue
        for cut in range(1, len(token)):
            left, right = ids.get(token[:cut]), ids.get(token[cut:])
            if left is not None and right is not None:
                found += (merged, left, right)
        if len(found) > 3 * limit:
            raise meta.error("tokenizer.ggml.tokens", f"(with tokenizer.ggml.scores, as the file has no "
                             f"tokenizer.ggml.merges) makes more than {limit} merges ({MAX_MERGES_PER_TOKEN} per "
                             "token; a real vocabulary makes fewer than 16)")
    rows = np.array(found, dtype=np.int64).reshape(-1, 3)
    order = np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0], -np.asarray(scores, dtype=np.float64)[rows[:, 0]]))
    return [(tokens[left], tokens[right]) for left, right in rows[order, 1:].tolist()]


def _set_post_processor(backend: Backend, tokens: list[str], bos: int | None, eos: int | None) -> None:
    """Add BOS/EOS around encoded text as the file's `add_bos_token`/`add_eos_token` ask. The template names them
    by role, their spellings being only the text of their pieces: a spelling in the template is read as its syntax
    (`$B` a sequence, `<s>:1` a type id), which made a BOS spelled `$B` panic on every encode."""
    if bos is None and eos is None:
        return
    before = ["BOS"] if bos is not None else []
    after = ["EOS"] if eos is not None else []
    backend.post_processor = processors.TemplateProcessing(
        single=[*before, "$A", *after], pair=[*before, "$A", *after, *before, "$B", *after],
        special_tokens=[{"id": role, "ids": [token_id], "tokens": [tokens[token_id]]}
                        for role, token_id in (("BOS", bos), ("EOS", eos)) if token_id is not None])
