"""Text in, token ids out, and back, for the runtime and for inferlets."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from itertools import compress
from operator import not_
from typing import Any

import tokenizers

from .chat_template import ChatTemplate
from .errors import ChatTemplateError, ModelLoadError, TemplateVariableError, is_library_error


_CONTENT_MARK = re.compile("\ue000([0-9]+)\ue001")
"""Stands in for message i's text while a chat template renders (private-use characters no template alters)."""
_BYTE_TOKEN = re.compile("<0x[0-9A-Fa-f]{2}>")
"""A SentencePiece byte-fallback token: one byte of a character the vocabulary has no piece for."""
SAMPLE_TEXT = "Hello, wörld! 123\n\t日本語 😀"


def check_encodes(backend: tokenizers.Tokenizer, source: str) -> None:
    """Encode `SAMPLE_TEXT` with and without special tokens, and decode it: a ModelLoadError naming ``source`` (the
    file) if the tokenizer cannot, so that it is refused at load, not on every request (a post-processor naming a
    sequence it is not given panics on every encode)."""
    try:
        for add_special_tokens in (True, False):
            (encoding,) = backend.encode_batch([SAMPLE_TEXT], add_special_tokens=add_special_tokens)
            backend.decode(encoding.ids, skip_special_tokens=False)
    except BaseException as exc:
        if not is_library_error(exc):
            raise
        raise ModelLoadError(f"{source}: the tokenizer cannot encode a sample text: {type(exc).__name__}: {exc}") \
            from None


def _byte_level_alphabet() -> dict[str, bytes]:
    """GPT-2's byte-level alphabet, each character to the byte it stands for: the printable bytes stand for
    themselves, the others are the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): bytes([b]) for b in printable}, **{chr(256 + i): bytes([b]) for i, b in enumerate(others)}}


_BYTE_OF = _byte_level_alphabet()


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's special token ids and chat template.

    Two kinds of text: text a program built to hold control tokens (a rendered chat template, an
    inferlet's prompt) goes through :meth:`encode`, where `<|im_start|>` is the control token; text a
    user typed goes through :meth:`encode_text` or, inside a conversation, :meth:`encode_chat`, where
    the same characters stay characters.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        template_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        """`template_tokens` are the strings a chat template sees as `bos_token`, `eos_token`, ...;
        those not given are the spellings of `bos_token_id` and the first of `eos_token_ids`."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        tokens = {
            "bos_token": self.id_to_token(bos_token_id),
            "eos_token": self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None,
        }
        tokens.update({k: v for k, v in (template_tokens or {}).items() if v is not None})
        self._template_tokens = tokens
        self._chat_template = ChatTemplate(chat_template, tokens) if chat_template else None
        self._control_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @property
    def control_ids(self) -> frozenset[int]:
        """The special tokens (BOS, EOS, chat markers): :meth:`decode` and the stream decoder leave them out of the
        text, and a user's text that spells one is encoded as plain characters."""
        return self._control_ids

    def to_json(self) -> str:
        """Everything :meth:`from_json` needs to make this tokenizer again, in another process."""
        return json.dumps({
            "backend": self.backend.to_str(),
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
            "template_tokens": self._template_tokens,
        })

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        spec = json.loads(text)
        return cls(
            tokenizers.Tokenizer.from_str(spec["backend"]),
            bos_token_id=spec["bos_token_id"],
            eos_token_ids=spec["eos_token_ids"],
            chat_template=spec["chat_template"],
            template_tokens=spec["template_tokens"],
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template.source if self._chat_template else None

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, control tokens spelled in it included; ``add_special_tokens`` adds the BOS."""
        # The backend's batch call lets other threads run while it encodes; its one-text encode holds the GIL.
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text a user typed: a control token's spelling in it is encoded as plain characters."""
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids = encoding.ids
        from_text = compress(ids, map(not_, encoding.special_tokens_mask))  # not the BOS the backend added
        if self._control_ids.isdisjoint(from_text):
            return ids  # no control token spelled: read as text, the same
        (encoding,) = self._text_backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    @cached_property
    def _text_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that reads control tokens as text, made for the first user text that spells one.
        (Switching the one backend for a call made every other thread's call wait, and a switch itself waits,
        holding the GIL, for the calls in flight; a copy made at load doubled the tokenizer's load time.)"""
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @cached_property
    def max_text_bytes_per_token(self) -> int | None:
        """The most UTF-8 bytes of a user's text one token can stand for, so ``n`` bytes of it are at least
        ``n / this`` tokens; None where no bound is known: a model that makes a run of characters it lacks one
        unknown token, a normalizer or pre-tokenizer that can drop text.

        A token stands for a stretch of the text as normalized for the model: its bytes (:meth:`token_bytes`), or,
        under a decoder not read here, its piece, which spells them in no fewer (a byte-level piece spends a
        character on each byte); an added token, its own text. The longest bounds it, times how much the
        normalizer may shrink the text. Control tokens are left out: user text never becomes one."""
        state = json.loads(self.backend.to_str())
        shrink = _most_shrink(state.get("normalizer"))
        if shrink is None or _drops_text(state.get("pre_tokenizer")) or _fuses_unknown_text(state["model"]):
            return None
        spelled = self._piece_bytes or (lambda piece: piece.encode("utf-8"))
        added = [token.content for token in self.backend.get_added_tokens_decoder().values() if not token.special]
        longest = max([
            4,  # an unknown character
            *(len(spelled(piece)) for piece, token_id in self.backend.get_vocab(with_added_tokens=False).items()
              if token_id not in self._control_ids),
            *(len(text.encode("utf-8")) for text in added),
        ])  # a list: with no pieces, max(4) would be max of the int 4, a TypeError
        return longest * shrink

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """A conversation as token ids: the template's control tokens as such, each message's text as text;
        ``variables``: more of the template's variables, checked by :meth:`template_variables`; ``tools``: the
        functions the model may call, as transformers gives them (``{"type": "function", "function": {...}}``).
        What the template shows besides the messages' text (the tools, a message's tool calls) becomes its own
        text, where a control token spelled would be one: the caller checks them (:meth:`control_token_in`).

        The template renders once with a mark in place of each message's text, so the text can be encoded
        apart. A template that changes the text it shows (trims it, say) cannot be rendered that way: then
        the conversation is rendered as it is, which is safe only when no message spells a control token,
        so one that does is refused.

        ``continue_final_message`` (vLLM's option) ends the ids at the end of the last message's text, leaving that
        message open for the model to go on (an assistant's reply begun by the caller); it needs the mark.
        """
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: a reply "
                                    "either goes on from the final message or starts a new one")
        last = len(messages) - 1
        marked = [  # empty text holds nothing to keep apart, and a template may leave it out (an assistant's tool calls)
            {**message, "content": f"\ue000{i}\ue001"}
            if isinstance(message.get("content"), str) and (message["content"] or continue_final_message and i == last)
            else message
            for i, message in enumerate(messages)
        ]
        if variables:
            variables = self.template_variables(variables)
        pieces = _CONTENT_MARK.split(self.apply_chat_template(marked, add_generation_prompt, variables, tools))
        text = self.apply_chat_template(messages, add_generation_prompt, variables, tools)
        contents = [messages[int(index)]["content"] for index in pieces[1::2]]
        rebuilt = "".join(piece if i % 2 == 0 else contents[i // 2] for i, piece in enumerate(pieces))
        marked_exactly = rebuilt == text and len(contents) == len({index for index in pieces[1::2]})
        if continue_final_message:
            final = str(len(messages) - 1)
            if not messages or not isinstance(messages[-1].get("content"), str) or not marked_exactly \
                    or final not in pieces[1::2]:
                raise ChatTemplateError("continue_final_message needs the final message's content as text, shown "
                                        "unchanged by the model's chat template")
            pieces = pieces[: pieces.index(final) + 1]  # what follows its text (its end of turn) is left out
        if marked_exactly:
            ids: list[int] = []
            for i, piece in enumerate(pieces):
                if i % 2 == 0:
                    ids += self.encode(piece, add_special_tokens=False) if piece else []
                else:
                    ids += self.encode_text(contents[i // 2], add_special_tokens=False)
            return ids
        for message in messages:
            content = message.get("content")
            spelled = self.control_token_in(content) if isinstance(content, str) else None
            if spelled is not None:
                raise ChatTemplateError(
                    f"a {message.get('role', 'message')} message spells the control token {spelled!r}, and this "
                    "model's chat template changes message text, so it cannot be kept as plain text"
                )
        return self.encode(text, add_special_tokens=False)

    def control_token_in(self, text: str) -> str | None:
        """The first control token spelled in ``text``, if any."""
        found = [(text.find(t.content), t.content) for t in self.backend.get_added_tokens_decoder().values()
                 if t.special and t.content and t.content in text]
        return min(found)[1] if found else None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, which may be part of a UTF-8 character (where :meth:`decode` of the
        token alone gives U+FFFD): a byte-level token's bytes, a byte-fallback token's one byte (``<0xC3>``), a
        SentencePiece piece with its ``\u2581`` as a space (kept even where a decoder drops the text's first
        space). A control token is its spelling; an id past the vocabulary (a model's padded rows) is ``b""``."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._piece_bytes is None:  # a decoder not read here: its text of the token alone
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return self._piece_bytes(piece)

    @cached_property
    def _piece_bytes(self) -> Callable[[str], bytes] | None:
        """How the backend's decoder turns one vocabulary piece into bytes, or None for a decoder not read here."""
        state = json.loads(self.backend.decoder.__getstate__()) if self.backend.decoder is not None else None
        steps = [] if state is None else state["decoders"] if state["type"] == "Sequence" else [state]
        if any(step["type"] == "ByteLevel" for step in steps):
            # As the decoder does: a character outside the byte alphabet (in an added token) is its own UTF-8.
            return lambda piece: b"".join(_BYTE_OF.get(char) or char.encode("utf-8") for char in piece)
        replacements: list[tuple[str, str]] = []
        byte_fallback = False
        for step in steps:
            if step["type"] == "Replace" and "String" in step["pattern"]:
                replacements.append((step["pattern"]["String"], step["content"]))
            elif step["type"] == "Metaspace":
                replacements.append((step["replacement"], " "))
            elif step["type"] == "ByteFallback":
                byte_fallback = True
            elif step["type"] not in ("Fuse", "Strip"):  # Strip trims the text's ends, not a token's
                return None

        def piece_bytes(piece: str) -> bytes:
            if byte_fallback and _BYTE_TOKEN.fullmatch(piece):
                return bytes([int(piece[3:5], 16)])
            for old, new in replacements:
                piece = piece.replace(old, new)
            return piece.encode("utf-8")

        return piece_bytes

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            variables: Mapping[str, Any] | None = None,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render a conversation (`[{"role": ..., "content": ...}, ...]`) into prompt text; ``variables``: more of the
        template's variables (see :meth:`template_variables`); ``tools``: the functions the model may call."""
        if self._chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        if tools:
            variables = {**(variables or {}), "tools": list(tools)}
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt, variables=variables)

    def template_variables(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """A caller's variables for the chat template (vLLM's ``chat_template_kwargs``), checked: names a render does
        not set itself, values that are booleans, numbers, null or text spelling no control token. The template puts
        them into the prompt as its own text, where a spelled control token would be read as one; a message's text
        never is (see :meth:`encode_chat`). TemplateVariableError names what is refused."""
        reserved = self._chat_template.reserved_variables if self._chat_template is not None else frozenset()
        for name, value in variables.items():
            if name in reserved:
                raise TemplateVariableError(f"{name!r} is set by the server for every conversation; it cannot be given")
            if isinstance(value, str):
                spelled = self.control_token_in(value)
                if spelled is not None:
                    raise TemplateVariableError(f"{name!r} spells the control token {spelled!r}")
            elif value is not None and not isinstance(value, (bool, int, float)):
                raise TemplateVariableError(f"{name!r} is {type(value).__name__}; a template variable is a boolean, a "
                                        "number, text or null")
        return dict(variables)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


_SHRINKING_NORMALIZERS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
"""Normalizers and how many times fewer UTF-8 bytes each can make of a text: at most a 4-byte character to a
1-byte one (NFKC makes \U0001d400 an A; composing jamo makes 9 bytes 3)."""


def _most_shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many times fewer bytes ``normalizer`` (its JSON) can make of a text; None where it may drop text."""
    if normalizer is None:
        return 1
    if normalizer["type"] == "Sequence":
        factor = 1
        for step in normalizer["normalizers"]:
            step_factor = _most_shrink(step)
            if step_factor is None:
                return None
            factor *= step_factor
        return factor
    if normalizer["type"] == "Replace":
        pattern = normalizer["pattern"].get("String")  # a regex may take any length
        grows = pattern and len(normalizer["content"].encode("utf-8")) >= len(pattern.encode("utf-8"))
        return 1 if grows else None
    return _SHRINKING_NORMALIZERS.get(normalizer["type"])


_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Punctuation", "Digits", "UnicodeScripts"})
"""Pre-tokenizers that put every character of the text in some piece (unless told to remove what they split on).
Any other may drop characters (Whitespace, BertPreTokenizer, CharDelimiterSplit's delimiter, ones to come)."""


def _drops_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether ``pre_tokenizer`` (its JSON) may leave characters out of every token (whitespace, say)."""
    if pre_tokenizer is None:
        return False
    if pre_tokenizer["type"] == "Sequence":
        return any(_drops_text(step) for step in pre_tokenizer["pretokenizers"])
    return pre_tokenizer["type"] not in _KEEPING_PRE_TOKENIZERS or pre_tokenizer.get("behavior") == "Removed"


def _fuses_unknown_text(model: dict[str, Any]) -> bool:
    """Whether one token of ``model`` (its JSON) may stand for any length of text its vocabulary lacks."""
    if model.get("byte_fallback"):
        return False
    if model["type"] == "BPE":
        return model.get("unk_token") is not None and bool(model.get("fuse_unk"))
    if model["type"] == "Unigram":
        return model.get("unk_id") is not None
    return True  # WordPiece, WordLevel: a word it lacks is one unknown token


class StreamDecoder:
    """Turns generated token ids into text as soon as the text is complete.

    A byte-level token can end partway through a UTF-8 character, which decodes to U+FFFD.
    Such a tail is held back until a later token completes it; everything before it goes out
    at once. Each step decodes a short window (the last already-emitted token plus the pending
    ones) rather than one token, so decoders that depend on context (SentencePiece's leading
    space) stay right.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._emitted = 0  # characters of the window's text already returned

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", never half a character)."""
        self._window.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the stream: return whatever is held back, incomplete characters as U+FFFD."""
        return self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, final: bool) -> str:
        text = self._decode(self._window)
        ready = text if final else text.rstrip("\ufffd")
        new = ready[self._emitted:]
        if len(ready) == len(text):  # all out: the last token is context enough for what follows
            self._window = self._window[-1:]
            self._emitted = len(self._decode(self._window))
        else:
            self._emitted = max(self._emitted, len(ready))
        return new
