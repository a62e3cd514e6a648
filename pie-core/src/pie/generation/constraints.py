"""Constrained generation: a JSON schema, a regex, a grammar or a list of choices as a mask over the next token.

Four pieces, each its own word:

- :class:`GrammarSpec` is what was asked for, as given (a schema, a pattern, grammar text, options).
- :class:`GrammarVocabulary` is the model's vocabulary as the grammar engine sees it, built from the
  model's own tokenizer (a ``tokenizer.json`` or one rebuilt from a GGUF file: the same
  ``tokenizers`` JSON either way), with its end-of-sequence tokens; one per tokenizer, made once.
- :class:`CompiledGrammar` is a spec compiled against a vocabulary: immutable, shared by every
  sequence that follows it, cached by the vocabulary.
- :class:`Matcher` is one sequence's place in the grammar. It masks the next token's logits
  (forbidden tokens get -inf) and is advanced by each accepted token; :meth:`Matcher.fork` copies
  it for a forked sequence. After each token the next mask is computed on a background thread, so
  it overlaps the forward pass that makes the next logits.

The grammar engine is llguidance (its Rust core, through its Python wheel): it compiles a typical JSON
schema and computes a mask over the vocabulary quickly (figures in ``docs/perf-notes.md``),
refuses the JSON Schema keywords it does not implement instead of ignoring them, and needs nothing
else installed. ``benchmarks/constrained_decode.py --compare-engines`` measures it against xgrammar.
It is optional: ``pip install 'pie-core[grammar]'`` (``pie-core[serve]`` includes it).

JSON output is written the way ``json.dumps`` writes it: ``", "`` and ``": "`` between items, no
other whitespace, so a small model cannot wander into endless newlines.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from pie.model.tokenizer import Tokenizer

GRAMMAR_EXTRA_HINT = "constrained generation needs llguidance: pip install 'pie-core[grammar]'"

GrammarKind = Literal["json_schema", "regex", "grammar", "choice"]

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON output is spaced (a schema's own ``x-guidance`` options override it)."""

COMPILED_CACHE_SIZE = 64
"""Compiled grammars a vocabulary keeps (the same schema sent by many requests compiles once)."""
COMPILED_CACHE_CHARS = 4 * 2**20
"""The most source text (characters of the specs) of the compiled grammars a vocabulary keeps, together.

A compiled grammar's own size is not known here: llguidance keeps its lexer and parser tables in Rust and does
not say how large they are. They grow with the source they are built from (a schema's properties, a list's
choices), faster than it for large schemas, so the source's length stands in for them, and bounds what many large
distinct specs can pin. A typical schema is a few kilobytes: the bound is met by large specs only."""
CACHED_SPEC_MAX_CHARS = 256 * 2**10
"""A spec whose source is longer than this is compiled for its request and not kept: one such spec would hold
much of :data:`COMPILED_CACHE_CHARS` and push out the many small ones that are sent again and again."""
TOO_DEEP = "the JSON schema is nested too deeply"


class GrammarError(ValueError):
    """A schema, regex, grammar or list of choices that cannot be compiled; the message says why."""

    def __init__(self, kind: GrammarKind, message: str):
        super().__init__(message)
        self.kind = kind


class GrammarUnavailable(RuntimeError):
    """Constrained generation cannot run here: llguidance is missing, or the tokenizer is one it cannot read."""


class TokenRejected(ValueError):
    """A token the grammar does not allow at this point was offered to :meth:`Matcher.accept`."""


NO_TEXT_ERROR = "NoExtensionBias"
"""llguidance's reason when no token can begin or extend the output: the constraint matches no text."""


def _engine_failure(kind: GrammarKind, what: str, state: Any) -> GrammarError:
    """The error of a matcher the grammar engine gave up on: a constraint that matches no text, or one past a limit
    of its lexer or parser (a pattern too large, a grammar that never ends), with the reason's first line and
    without the engine's state dump."""
    reason = (state.get_error().strip() or "no reason given").splitlines()[0]
    if reason == NO_TEXT_ERROR:
        return GrammarError(kind, f"the {what} matches no text this model can write")
    return GrammarError(kind, f"the grammar engine cannot follow the {what}: {reason}")


def compile_failure(error: str) -> str:
    """llguidance's reason a grammar did not compile, without the backtrace of a panic inside it (a grammar of
    tens of thousands of rules fails an assertion of its own), which says nothing to a client."""
    return error.split("\n<backtrace>", 1)[0].strip()


class OutputIncomplete(ValueError):
    """Constrained generation reached its token limit before the output was complete.

    ``text`` and ``tokens`` are what was generated: a prefix of a valid output, not one.
    """

    def __init__(self, text: str, tokens: Sequence[int], max_tokens: int):
        shown = text if len(text) <= 60 else text[:60] + "..."
        super().__init__(f"the output was not complete after max_tokens ({max_tokens}): {shown!r}")
        self.text = text
        self.tokens = list(tokens)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise GrammarUnavailable(GRAMMAR_EXTRA_HINT) from exc
    return llguidance


def grammar_available() -> bool:
    """Whether llguidance can be imported (without importing anything else)."""
    try:
        _llguidance()
    except GrammarUnavailable:
        return False
    return True


# -- what was asked for ------------------------------------------------------------------


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint as asked for: its kind and its source text. Make one with the class methods."""

    kind: GrammarKind
    source: str
    """The JSON schema as JSON text, the regex, the grammar text, or the choices as a JSON list."""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> GrammarSpec:
        """Output that is one JSON value valid against ``schema`` (a dict, ``True``, or JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError("json_schema", f"the JSON schema is not valid JSON: {exc}") from None
            except RecursionError:  # Python's JSON reader recurses: "[" * 1000 is 1 KB of text too deep for it
                raise GrammarError("json_schema", TOO_DEEP) from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("json_schema", f"a JSON schema is an object (or true), not {type(schema).__name__}")
        if schema is False:
            raise GrammarError("json_schema", "the JSON schema false matches no value")
        if schema is True:  # any JSON value: the grammar engine takes only objects, and {} says the same
            schema = {}
        try:
            return cls("json_schema", json.dumps(schema, allow_nan=False))
        except RecursionError:
            raise GrammarError("json_schema", TOO_DEEP) from None
        except (TypeError, ValueError) as exc:
            raise GrammarError("json_schema", f"the JSON schema cannot be written as JSON: {exc}") from None

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (OpenAI's ``json_object`` response format)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """Output that the regular expression matches whole (Rust ``regex`` syntax, no anchors needed)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("regex", "the regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> GrammarSpec:
        """Output that a context-free grammar derives: Lark syntax (llguidance's), or llama.cpp's GBNF."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("grammar", "the grammar must be a non-empty string")
        return cls("grammar", text)

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        """Output that is exactly one of ``options``."""
        if not isinstance(options, (list, tuple)) or not all(isinstance(o, str) for o in options):
            raise GrammarError("choice", "the choices must be a list of strings")
        if not options or not all(options):
            raise GrammarError("choice", "give at least one choice, and no empty one")
        return cls("choice", json.dumps(list(options)))

    def describe(self) -> str:
        return {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}[self.kind]


def _engine_grammar(spec: GrammarSpec) -> str:
    """The spec as llguidance's grammar definition (compiled, and checked, when a matcher is made from it)."""
    llg = _llguidance()
    matcher = llg.LLMatcher
    try:
        if spec.kind == "json_schema":
            return matcher.grammar_from_json_schema(spec.source, defaults=JSON_STYLE)
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":  # one alternation for the lexer: the parser's rows would hold one item an option
            return matcher.grammar_from_regex("|".join(map(_regex_literal, json.loads(spec.source))))
        return llg.grammar_from("grammar", spec.source)  # Lark as it is; GBNF converted to Lark
    except ValueError as exc:
        raise GrammarError(spec.kind, f"invalid {spec.describe()}: {exc}") from None


_REGEX_SPECIALS = re.compile(r"[\\.+*?()|\[\]{}^$#&\-~]")
"""The characters a Rust ``regex`` literal escapes (those of ``regex::escape``)."""


def _regex_literal(text: str) -> str:
    return _REGEX_SPECIALS.sub(lambda match: "\\" + match[0], text)


# -- the vocabulary ----------------------------------------------------------------------


class GrammarVocabulary:
    """The model's tokens as the grammar engine sees them (their bytes, the end-of-sequence tokens).

    Built from the model's own ``tokenizers`` JSON, so byte-level BPE and SentencePiece byte-fallback
    vocabularies, from a Hugging Face folder or a GGUF file, are read the same way. Building one reads
    the whole vocabulary, which is slow: use :meth:`for_tokenizer`, which makes one per tokenizer and
    keeps it.
    """

    _made: weakref.WeakKeyDictionary[Tokenizer, dict[int, GrammarVocabulary]] = weakref.WeakKeyDictionary()
    _made_lock = threading.Lock()

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        llg = _llguidance()
        self.vocab_size = vocab_size
        """Entries of a row of logits (the model's, which may exceed the tokenizer's own vocabulary)."""
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        try:
            self.engine = llg.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids) or None
            )
        except Exception as exc:  # the library's message (an unknown tokenizer model, a vocabulary too large)
            raise GrammarUnavailable(f"this model's tokenizer cannot drive a grammar: {exc}") from None
        self._compiled: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cached_chars = 0
        """The source text of the specs in ``_compiled``, together (see :data:`COMPILED_CACHE_CHARS`)."""
        self._compiling: dict[GrammarSpec, Future[CompiledGrammar]] = {}
        """The specs being compiled now, each for the first caller that asked: later callers wait for its result."""
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarVocabulary:
        """The vocabulary of ``tokenizer`` for rows of ``vocab_size`` logits, made on first use and kept."""
        with cls._made_lock:
            sizes = cls._made.setdefault(tokenizer, {})
            if vocab_size not in sizes:
                sizes[vocab_size] = cls(tokenizer, vocab_size)
            return sizes[vocab_size]

    def token_text(self, token: int) -> str:
        return self.engine.decode_str([token])

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled (or taken from the cache); :class:`GrammarError` says what is wrong with it.

        Compiling releases the GIL; a large schema can take seconds, so a server calls this off its event loop.
        Callers asking for a spec that is being compiled wait for that compile, and get its grammar or its error.
        """
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
                return found
            compiling = self._compiling.get(spec)
            another_compiles = compiling is not None
            if compiling is None:
                compiling = self._compiling[spec] = Future()
        if another_compiles:
            return compiling.result()
        try:
            compiled = self._compile(spec)
        except BaseException as exc:  # the waiting callers get it too (a KeyboardInterrupt as well: never a hang)
            with self._lock:
                del self._compiling[spec]
            compiling.set_exception(exc)
            raise
        with self._lock:
            del self._compiling[spec]
            self._keep(spec, compiled)
        compiling.set_result(compiled)
        return compiled

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        llg = _llguidance()
        template = llg.LLMatcher(self.engine, _engine_grammar(spec), log_level=0)
        if template.is_error():
            raise GrammarError(spec.kind, f"invalid {spec.describe()}: {compile_failure(template.get_error())}")
        compiled = CompiledGrammar(self, spec, template)
        start = compiled.matcher()
        if not start.is_accepting and self.eos_token_ids.issuperset(np.flatnonzero(start.allowed()).tolist()):
            # Only the end of the sequence may come first, and the output is not complete: no text matches.
            raise GrammarError(spec.kind, f"the {spec.describe()} matches no text this model can write")
        return compiled

    def _keep(self, spec: GrammarSpec, compiled: CompiledGrammar) -> None:
        """Cache ``compiled`` (unless its source is too long to), leaving out the least recently used grammars
        past :data:`COMPILED_CACHE_SIZE` grammars or :data:`COMPILED_CACHE_CHARS` of source. Under ``_lock``."""
        if len(spec.source) > CACHED_SPEC_MAX_CHARS:
            return
        self._compiled[spec] = compiled
        self._cached_chars += len(spec.source)
        while len(self._compiled) > COMPILED_CACHE_SIZE or self._cached_chars > COMPILED_CACHE_CHARS:
            left_out, _ = self._compiled.popitem(last=False)
            self._cached_chars -= len(left_out.source)


# -- compiled grammars and matchers --------------------------------------------------------


class CompiledGrammar:
    """A spec compiled for one vocabulary. Never advanced itself: every :meth:`matcher` starts from it."""

    def __init__(self, vocabulary: GrammarVocabulary, spec: GrammarSpec, template: Any):
        self.vocabulary = vocabulary
        self.spec = spec
        self._template = template

    def __repr__(self) -> str:
        return f"<CompiledGrammar {self.spec.kind}: {self.spec.source[:60]!r}>"

    def matcher(self) -> Matcher:
        """A matcher at the grammar's start (its first mask starts computing at once)."""
        return Matcher(self, self._template.deep_copy())


_mask_thread: ThreadPoolExecutor | None = None
_mask_thread_lock = threading.Lock()


def _background() -> ThreadPoolExecutor:
    """The one thread that computes masks ahead of need (started on first use: a sandboxed inferlet
    worker locks itself down single-threaded, and starts it afterwards)."""
    global _mask_thread
    with _mask_thread_lock:
        if _mask_thread is None:
            _mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pie-grammar")
        return _mask_thread


class Matcher:
    """One sequence's place in a grammar: masks the next token's logits, advanced by each accepted token.

    Use one matcher per sequence, from one thread. :attr:`is_finished` says the grammar is complete and
    nothing may follow (the generation ends there); :attr:`is_accepting` says the output so far is
    complete but may go on (an end-of-sequence token is then allowed).
    """

    def __init__(self, grammar: CompiledGrammar, state: Any, *, _copy_of: Matcher | None = None):
        self.grammar = grammar
        vocabulary = grammar.vocabulary
        self.vocab_size = vocabulary.vocab_size
        self.end_token_ids = vocabulary.eos_token_ids
        """Tokens that end the output where the grammar allows an end (the model's end-of-sequence tokens)."""
        self._state = state
        self._pending: Future[None] | None = None
        self._accepting = self._finished = False
        if _copy_of is None:
            self._bits = np.zeros((self.vocab_size + 31) // 32, np.int32)
            self._allowed: np.ndarray | None = None
            self.tokens = 0
            self._refresh()
        else:
            self._bits = _copy_of._bits.copy()
            self._allowed = _copy_of._allowed
            self.tokens = _copy_of.tokens
            self._accepting, self._finished = _copy_of._accepting, _copy_of._finished

    def __repr__(self) -> str:
        where = "finished" if self._finished else "accepting" if self._accepting else "open"
        return f"<Matcher {self.grammar.spec.kind} after {self.tokens} tokens: {where}>"

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete: it could end here."""
        return self._accepting

    @property
    def is_finished(self) -> bool:
        """The output is complete and nothing may follow it."""
        return self._finished

    def allowed(self) -> np.ndarray:
        """Which tokens may come next: a boolean array over the vocabulary (do not modify it)."""
        self._settle()
        if self._allowed is None:
            bits = np.unpackbits(self._bits.view(np.uint8), count=self.vocab_size, bitorder="little")
            self._allowed = bits.view(np.bool_)
        return self._allowed

    def allows(self, token: int) -> bool:
        self._settle()
        return 0 <= token < self.vocab_size and bool((int(self._bits[token >> 5]) >> (token & 31)) & 1)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` (one row, float32) with every token the grammar forbids set to -inf."""
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def accept(self, token: int) -> None:
        """Advance past ``token``; :class:`TokenRejected` (the matcher unchanged) if the grammar forbids it."""
        if not self.allows(token):
            text = self.grammar.vocabulary.token_text(token) if 0 <= token < self.vocab_size else "?"
            raise TokenRejected(f"token {token} ({text!r}) is not allowed by the {self.grammar.spec.describe()} here")
        if not self._state.consume_token(token):  # the mask allowed it: the engine reached one of its limits
            raise _engine_failure(self.grammar.spec.kind, self.grammar.spec.describe(), self._state)
        self.tokens += 1
        self._refresh()

    def fork(self) -> Matcher:
        """An independent copy at the same place (for a forked sequence); the mask is copied, not recomputed."""
        self._settle()
        return Matcher(self.grammar, self._state.deep_copy(), _copy_of=self)

    def _refresh(self) -> None:
        """Read the new state and start computing the next mask in the background."""
        state = self._state
        self._accepting = bool(state.is_accepting())
        self._finished = bool(state.is_stopped())
        self._allowed = None
        self._pending = _background().submit(_compute_mask, state, self._bits)

    def _settle(self) -> None:
        """Wait for the mask being computed (the engine's state is not to be touched meanwhile); a
        :class:`GrammarError` if the engine gave up computing it (its mask then allows only the end)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        if self._state.is_error():
            raise _engine_failure(self.grammar.spec.kind, self.grammar.spec.describe(), self._state)


def _compute_mask(state: Any, bits: np.ndarray) -> None:
    """Write the next token's mask into ``bits``. The job holds ``bits`` itself, not just its address: a
    matcher dropped while its mask is still being computed must not have the array freed under the write."""
    state.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
