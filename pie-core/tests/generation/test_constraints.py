"""Constrained generation: the vocabulary bridge, matchers (masks, forks, errors), and `pie run`'s two flags."""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter
from typer.testing import CliRunner

from pie.cli import app
from pie.generation import constraints
from pie.generation.constraints import (
    GrammarError,
    GrammarSpec,
    GrammarUnavailable,
    GrammarVocabulary,
    Matcher,
    TokenRejected,
    compile_failure,
    grammar_available,
)
from pie.model.gguf_header import GGUFHeader
from pie.model.gguf_metadata import GGUFMetadata
from pie.model.gguf_tokenizer import tokenizer_from_gguf
from pie.model.loader import load_model
from pie.model.tokenizer import Tokenizer
from pie.testing.models import EOS_TOKEN_ID, make_gguf_model, tiny_tokenizer

pytest.importorskip("llguidance", reason="constrained generation needs the grammar extra")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("constraints") / "tiny.gguf", "F32")


@pytest.fixture(scope="module")
def hf_tokenizer() -> Tokenizer:
    """The test tokenizer as a Hugging Face folder's tokenizer.json gives it."""
    return Tokenizer(tiny_tokenizer(), bos_token_id=0, eos_token_ids=(EOS_TOKEN_ID,))


@pytest.fixture(scope="module")
def gguf_tokenizer(tiny_gguf: Path) -> Tokenizer:
    """The same vocabulary rebuilt from a GGUF file's metadata."""
    return load_model(tiny_gguf).tokenizer


def sentencepiece_tokenizer(path: Path) -> Tokenizer:
    """A llama-style SentencePiece vocabulary (byte fallback, scores instead of merges) from a GGUF file."""
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "ll", "\u2581he", "llo", "\u2581hello",
              "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "{", "}", '"', ":"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_token_scores([0.0] * 259 + [-float(rank) for rank in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokenizer_from_gguf(GGUFMetadata(GGUFHeader(path)))


def token_bytes(tokenizer: Tokenizer, token: int, anchor: int) -> bytes | None:
    """What ``token`` adds to the text after ``anchor`` (so SentencePiece keeps its leading space), as bytes;
    None when it is part of a character, or a control token."""
    before = tokenizer.decode([anchor], skip_special_tokens=False)
    text = tokenizer.decode([anchor, token], skip_special_tokens=False)
    if "\ufffd" in text or not text.startswith(before):
        return None
    return text[len(before):].encode("utf-8")


def compare_token_bytes(tokenizer: Tokenizer, vocabulary: GrammarVocabulary, tokens: list[int]) -> int:
    """Assert that llguidance's bytes of each token are the tokenizer's (``token_bytes``, parts of characters too)
    and, where the token adds whole characters after an anchor, the text it adds; returns how many did."""
    anchor = tokenizer.encode("h", add_special_tokens=False)[-1]
    compared = 0
    for token in tokens:
        theirs = vocabulary.engine.decode_bytes([token])
        whole = tokenizer.token_bytes(token)
        # llguidance marks its special tokens with a first byte 0xFF and leaves them out: the token 0xFF too.
        assert whole == theirs or (whole, theirs) == (b"\xff", b""), (token, tokenizer.id_to_token(token))
        ours = token_bytes(tokenizer, token, anchor)
        if ours is not None:
            assert theirs == ours, (token, tokenizer.id_to_token(token))
            compared += 1
    return compared


@pytest.mark.parametrize("which", ["hf", "gguf", "sentencepiece"])
def test_the_vocabulary_is_the_models_own_tokens(which: str, hf_tokenizer: Tokenizer, gguf_tokenizer: Tokenizer,
                                                 tmp_path: Path) -> None:
    tokenizer = {"hf": lambda: hf_tokenizer, "gguf": lambda: gguf_tokenizer,
                 "sentencepiece": lambda: sentencepiece_tokenizer(tmp_path / "sp.gguf")}[which]()
    vocabulary = GrammarVocabulary.for_tokenizer(tokenizer, tokenizer.vocab_size)
    assert GrammarVocabulary.for_tokenizer(tokenizer, tokenizer.vocab_size) is vocabulary, "made once"
    assert vocabulary.eos_token_ids == frozenset(tokenizer.eos_token_ids)
    control = {*tokenizer.eos_token_ids, tokenizer.bos_token_id}
    compared = compare_token_bytes(tokenizer, vocabulary, [t for t in range(tokenizer.vocab_size) if t not in control])
    assert compared > tokenizer.vocab_size // 2
    if which == "sentencepiece":  # byte tokens: a character outside the pieces is spelled in its UTF-8 bytes
        byte_c3 = tokenizer.token_to_id("<0xC3>")
        assert vocabulary.engine.decode_bytes([byte_c3]) == b"\xc3"
        matcher = vocabulary.compile(GrammarSpec.regex("é+")).matcher()
        assert matcher.allows(byte_c3) and not matcher.allows(tokenizer.token_to_id("h"))


@pytest.mark.slow
def test_the_vocabulary_of_smollm2_is_its_own_tokens() -> None:
    from pie.model.store import DEFAULT_MODEL, resolve_model

    loaded = load_model(resolve_model(DEFAULT_MODEL))
    tokenizer = loaded.tokenizer
    vocabulary = GrammarVocabulary.for_tokenizer(tokenizer, loaded.config.vocab_size)
    special = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special}
    tokens = [t for t in range(loaded.config.vocab_size) if tokenizer.id_to_token(t) not in special]
    assert compare_token_bytes(tokenizer, vocabulary, tokens) > 45_000
    assert vocabulary.eos_token_ids == {tokenizer.token_to_id("<|im_end|>")}


def test_a_mask_covers_the_models_rows_and_ends_only_where_the_grammar_may(hf_tokenizer: Tokenizer) -> None:
    padded = hf_tokenizer.vocab_size + 37  # a model whose embedding has rows past the tokenizer's vocabulary
    matcher = GrammarVocabulary.for_tokenizer(hf_tokenizer, padded).compile(GrammarSpec.regex("[0-9]+")).matcher()
    allowed = matcher.allowed()
    assert allowed.shape == (padded,) and not allowed[hf_tokenizer.vocab_size:].any()
    assert not allowed[EOS_TOKEN_ID], "nothing generated yet: the regex cannot end"
    digits = [t for t in range(hf_tokenizer.vocab_size) if hf_tokenizer.decode([t]).isdigit()]
    assert set(np.flatnonzero(allowed)) == set(digits)
    logits = np.random.default_rng(0).normal(size=padded).astype(np.float32)
    masked = matcher.mask(logits)
    assert masked.dtype == np.float32 and np.isneginf(masked[~allowed]).all()
    assert (masked[allowed] == logits[allowed]).all() and np.isfinite(logits).all(), "the input is left alone"
    matcher.accept(digits[0])
    assert matcher.is_accepting and not matcher.is_finished and matcher.allows(EOS_TOKEN_ID)
    matcher.accept(EOS_TOKEN_ID)
    assert matcher.is_finished


def sample(matcher: Matcher, rng: np.random.Generator, limit: int = 200) -> list[int]:
    """Random tokens the matcher allows until it is finished (or ends at an end token)."""
    out: list[int] = []
    while not matcher.is_finished and len(out) < limit:
        logits = rng.normal(size=matcher.vocab_size).astype(np.float32)
        token = int(matcher.mask(logits).argmax())
        matcher.accept(token)
        if token in matcher.end_token_ids:
            break
        out.append(token)
    return out


def test_forks_copy_the_state_and_then_go_their_own_ways(hf_tokenizer: Tokenizer) -> None:
    vocabulary = GrammarVocabulary.for_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size)
    pattern = r"(ab|cd)-[0-9]{2}-(x+|y+)"
    parent = vocabulary.compile(GrammarSpec.regex(pattern)).matcher()
    prefix = hf_tokenizer.encode("ab-", add_special_tokens=False)
    for token in prefix:
        parent.accept(token)
    children = [parent.fork() for _ in range(6)]
    assert all((child.allowed() == parent.allowed()).all() for child in children), "a fork starts at the same place"
    texts = [hf_tokenizer.decode(prefix + sample(child, np.random.default_rng(seed))) for seed, child in
             enumerate(children)]
    assert all(re.fullmatch(pattern, text) for text in texts), texts
    assert len(set(texts)) > 1
    assert parent.tokens == len(prefix) and not parent.is_accepting, "the children's tokens never reached the parent"
    assert hf_tokenizer.decode(prefix + sample(parent, np.random.default_rng(99))).startswith("ab-")


def test_a_forbidden_token_is_refused_and_leaves_the_matcher_usable(hf_tokenizer: Tokenizer) -> None:
    vocabulary = GrammarVocabulary.for_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size)
    matcher = vocabulary.compile(GrammarSpec.choice(["yes", "no"])).matcher()
    letter_z = hf_tokenizer.encode("z", add_special_tokens=False)[0]
    with pytest.raises(TokenRejected, match=r"'z'.*not allowed by the choice"):
        matcher.accept(letter_z)
    for token in hf_tokenizer.encode("no", add_special_tokens=False):
        matcher.accept(token)
    assert matcher.is_finished and matcher.is_accepting


def test_matchers_dropped_while_their_mask_is_computed_free_nothing_in_use(hf_tokenizer: Tokenizer) -> None:
    grammar = GrammarVocabulary.for_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size).compile(
        GrammarSpec.json_schema({"type": "array", "items": {"type": "string"}}))
    for _ in range(300):
        matcher = grammar.matcher()  # its first mask starts at once, on the background thread
        del matcher
        gc.collect(0)
    assert grammar.matcher().allows(hf_tokenizer.encode("[", add_special_tokens=False)[0])


def test_the_same_spec_compiles_once(hf_tokenizer: Tokenizer) -> None:
    vocabulary = GrammarVocabulary.for_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size)
    first = vocabulary.compile(GrammarSpec.json_schema('{"type": "integer"}'))
    assert vocabulary.compile(GrammarSpec.json_schema({"type": "integer"})) is first


def counted_engine_compiles(monkeypatch: pytest.MonkeyPatch, *, then: Callable[[int], None] = lambda calls: None
                            ) -> list[GrammarSpec]:
    """The specs the grammar engine is asked to compile, from now on; ``then`` runs after each one is noted."""
    asked: list[GrammarSpec] = []
    engine_grammar = constraints._engine_grammar

    def noting(spec: GrammarSpec) -> str:
        asked.append(spec)
        then(len(asked))
        return engine_grammar(spec)

    monkeypatch.setattr(constraints, "_engine_grammar", noting)
    return asked


@pytest.mark.parametrize("pattern,fails", [("[0-9]+", None), (r"[^\s\S]", "matches no text")])
def test_callers_of_a_spec_being_compiled_share_its_compile(
    pattern: str, fails: str | None, hf_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four requests with the same large schema each compiled it (4.4x the CPU of one): the cache was filled only
    once a compile had ended. A second caller now waits for the first one's compile, and gets its grammar or error."""
    first_compiling, second_caller_in, release = threading.Event(), threading.Event(), threading.Event()

    def hold_the_first(calls: int) -> None:
        if calls > 1:  # the second caller compiles it again: the test need not wait for it to wait
            second_caller_in.set()
            return
        first_compiling.set()
        assert release.wait(30)

    class NotedFuture(Future):
        def result(self, timeout: float | None = None) -> Any:
            second_caller_in.set()
            return super().result(timeout)

    asked = counted_engine_compiles(monkeypatch, then=hold_the_first)
    monkeypatch.setattr(constraints, "Future", NotedFuture)
    vocabulary = GrammarVocabulary(hf_tokenizer, hf_tokenizer.vocab_size)
    spec = GrammarSpec.regex(pattern)
    results: list[object] = [None, None]

    def compile_into(slot: int) -> None:
        try:
            results[slot] = vocabulary.compile(spec)
        except GrammarError as exc:
            results[slot] = exc

    callers = [threading.Thread(target=compile_into, args=(slot,)) for slot in range(2)]
    callers[0].start()
    try:
        assert first_compiling.wait(30)
        callers[1].start()
        assert second_caller_in.wait(30)
    finally:
        release.set()
        for caller in callers:
            caller.join(30)
    assert asked == [spec], "one compile for both callers"
    if fails is None:
        assert results[0] is results[1] and results[0] is not None
    else:
        assert all(isinstance(result, GrammarError) and fails in str(result) for result in results), results


def test_the_cache_keeps_a_bounded_length_of_source(hf_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cached 1 MB spec pinned tens of MB of compiled tables, 64 of them kept: gigabytes held by one client."""
    monkeypatch.setattr(constraints, "COMPILED_CACHE_CHARS", 100)
    monkeypatch.setattr(constraints, "CACHED_SPEC_MAX_CHARS", 60)
    asked = counted_engine_compiles(monkeypatch)
    vocabulary = GrammarVocabulary(hf_tokenizer, hf_tokenizer.vocab_size)
    a, b, c = (GrammarSpec.regex(f"{word}[0-9]{{1,3}}" + "[a-z]" * 6) for word in ("aa", "bb", "cc"))
    large = GrammarSpec.regex("x" + "[0-9]" * 14)
    assert len(a.source) == 42 and len(large.source) == 71
    for spec in (a, b, c, b, c):  # a, b and c together are past 100 characters: a (the least recently used) goes
        vocabulary.compile(spec)
    assert asked == [a, b, c]
    for spec in (large, large, b, c, a):  # a spec past 60 characters is never kept, nor pushes another one out
        vocabulary.compile(spec)
    assert asked == [a, b, c, large, large, a]


def nested_objects(depth: int) -> dict[str, Any]:
    """``{"items": {"items": ... {}}}``, ``depth`` objects deep (a schema an inferlet might build by mistake)."""
    schema: dict[str, Any] = {}
    for _ in range(depth):
        schema = {"items": schema}
    return schema


@pytest.mark.parametrize("make,kind,says", [
    (lambda: GrammarSpec.json_schema('{"type": '), "json_schema", "not valid JSON"),
    (lambda: GrammarSpec.json_schema([1, 2]), "json_schema", "is an object"),
    (lambda: GrammarSpec.json_schema({"type": "strin"}), "json_schema", "Invalid type: strin"),
    (lambda: GrammarSpec.json_schema({"type": "string", "format": "shoe-size"}), "json_schema", "Unknown format"),
    (lambda: GrammarSpec.json_schema({"not": {"type": "string"}}), "json_schema", "not"),
    (lambda: GrammarSpec.json_schema({"$ref": "#/$defs/missing"}), "json_schema", "missing"),
    (lambda: GrammarSpec.json_schema(False), "json_schema", "the JSON schema false matches no value"),
    (lambda: GrammarSpec.json_schema("[" * 5000), "json_schema", "the JSON schema is nested too deeply"),
    (lambda: GrammarSpec.json_schema(nested_objects(5000)), "json_schema", "the JSON schema is nested too deeply"),
    (lambda: GrammarSpec.regex("a(b"), "regex", "unclosed group"),
    (lambda: GrammarSpec.regex(""), "regex", "non-empty"),
    (lambda: GrammarSpec.grammar("start: undefined"), "grammar", "unknown name"),
    (lambda: GrammarSpec.grammar('root ::= "a" | ('), "grammar", "grammar"),
    (lambda: GrammarSpec.choice("yes"), "choice", "list of strings"),
    (lambda: GrammarSpec.choice(["yes", ""]), "choice", "no empty one"),
    (lambda: GrammarSpec.regex(r"[^\s\S]"), "regex", "the regex matches no text this model can write"),
])
def test_a_bad_constraint_says_what_is_wrong(make, kind: str, says: str, hf_tokenizer: Tokenizer) -> None:
    vocabulary = GrammarVocabulary.for_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size)
    with pytest.raises(GrammarError) as caught:
        vocabulary.compile(make())
    assert caught.value.kind == kind and says in str(caught.value)


def test_a_constraint_beyond_the_engines_limits_is_an_error_never_an_early_end(hf_tokenizer: Tokenizer) -> None:
    """Where llguidance gives up (a lexer or parser limit), its mask allows only the end: that must be an error
    naming the limit, not an empty or cut output that looks complete."""
    vocabulary = GrammarVocabulary.for_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size)
    with pytest.raises(GrammarError, match="grammar engine cannot follow the regex: lexer error") as caught:
        vocabulary.compile(GrammarSpec.regex("a{1000000}")).matcher().allowed()
    assert caught.value.kind == "regex"
    for spec in (GrammarSpec.grammar('root ::= "x" root'),  # never ends
                 GrammarSpec.json_schema({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                          "required": ["next"]}}, "$ref": "#/$defs/n"})):
        matcher = vocabulary.compile(spec).matcher()
        with pytest.raises(GrammarError, match=f"cannot follow the {spec.describe()}: parser error") as caught:
            sample(matcher, np.random.default_rng(0), limit=5)
        assert "<state>" not in str(caught.value), "the engine's state dump stays out of the message"
        with pytest.raises(GrammarError):
            matcher.allowed()  # and the matcher stays failed: no mask of nothing but the end


def test_the_schema_true_takes_any_json_value(hf_tokenizer: Tokenizer) -> None:
    grammar = GrammarVocabulary.for_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size).compile(GrammarSpec.json_schema(True))
    for text in ("[1]", '"a"', "7"):
        matcher = grammar.matcher()
        for token in hf_tokenizer.encode(text, add_special_tokens=False):
            matcher.accept(token)
        assert matcher.is_accepting, text


def test_choices_are_literal_text_and_thousands_of_them_are_followed(hf_tokenizer: Tokenizer) -> None:
    specials = ["a.b", "(x)|y", "1+1?", "[q]-{2}", "$^#&~"]
    grammar = GrammarVocabulary.for_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size).compile(
        GrammarSpec.choice(specials + [f"opt{i}" for i in range(3000)]))
    for option in (*specials, "opt2999"):
        matcher = grammar.matcher()
        for token in hf_tokenizer.encode(option, add_special_tokens=False):
            matcher.accept(token)
        assert matcher.is_accepting, option
    matcher = grammar.matcher()
    matcher.accept(hf_tokenizer.encode("a", add_special_tokens=False)[0])
    assert not matcher.allows(hf_tokenizer.encode("X", add_special_tokens=False)[0]), "'.' is a dot, not any character"


def test_without_llguidance_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch, hf_tokenizer: Tokenizer) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if it were not installed
    assert not grammar_available()
    with pytest.raises(GrammarUnavailable, match=r"pip install 'pie-core\[grammar\]'"):
        GrammarVocabulary(hf_tokenizer, hf_tokenizer.vocab_size)


# -- pie run --json-schema / --regex -----------------------------------------------------

runner = CliRunner()

SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["word", "n"],
    "additionalProperties": False,
}


def pie_run(tiny_gguf: Path, *args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["run", "Tell me", "--model", str(tiny_gguf), "--engine", "cpu", *args])
    return result.exit_code, result.stdout, result.stderr


def test_pie_run_json_schema_prints_valid_json(tiny_gguf: Path, tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    code, out, err = pie_run(tiny_gguf, "--json-schema", str(schema_file), "--max-tokens", "60", "--temperature",
                             "0.8", "--seed", "2")
    assert code == 0, err
    jsonschema.validate(json.loads(out), SCHEMA)
    code, out, err = pie_run(tiny_gguf, "--json-schema", str(schema_file), "--max-tokens", "3")
    assert code == 1 and "stopped at --max-tokens 3 before it matched --json-schema" in err
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_pie_run_regex(tiny_gguf: Path) -> None:
    code, out, err = pie_run(tiny_gguf, "--regex", "[a-f]{3}-[0-9]{2}", "--temperature", "1", "--seed", "1")
    assert code == 0, err
    assert re.fullmatch(r"[a-f]{3}-[0-9]{2}", out.strip()), out


@pytest.mark.parametrize("args,status,says", [
    (["--regex", "a(b"], 1, "--regex: invalid regex"),
    (["--json-schema", "/nonexistent/schema.json"], 1, "--json-schema /nonexistent/schema.json: cannot read it"),
    (["--regex", "x", "--json-schema", "s.json"], 2, "give --json-schema or --regex, not both"),  # a usage error
    (["--regex", "a{1000000}"], 1, "--regex: the grammar engine cannot follow the regex: lexer error"),
    (["--regex", r"[^\s\S]"], 1, "--regex: the regex matches no text this model can write"),
])
def test_pie_run_refuses_a_bad_constraint_in_one_line(tiny_gguf: Path, args: list[str], status: int, says: str) -> None:
    code, _, err = pie_run(tiny_gguf, *args)
    assert code == status and says in err and "Traceback" not in err


def test_pie_run_names_the_bad_schema_file(tiny_gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objekt"}')
    code, _, err = pie_run(tiny_gguf, "--json-schema", str(bad))
    assert code == 1 and f"--json-schema {bad}: invalid JSON schema" in err and "objekt" in err


def test_pie_run_names_a_schema_file_nested_too_deeply(tiny_gguf: Path, tmp_path: Path) -> None:
    """Python's JSON reader gives up on 3000 nested arrays (a 3 KB file): that was "pie: internal error"."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 3000 + "]" * 3000)
    code, _, err = pie_run(tiny_gguf, "--json-schema", str(deep))
    assert code == 1 and f"--json-schema {deep}: the JSON schema is nested too deeply" in err, err
    assert "internal error" not in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_pie_run_reads_only_a_regular_schema_file(tiny_gguf: Path, tmp_path: Path, kind: str) -> None:
    """/dev/zero was read until the kernel killed pie for memory, and a FIFO was waited on for ever."""
    path = {"device": Path("/dev/zero"), "folder": tmp_path}.get(kind, tmp_path / "fifo")
    if kind == "fifo":
        os.mkfifo(path)
    code, _, err = pie_run(tiny_gguf, "--json-schema", str(path))
    assert code == 1 and f"--json-schema {path}: cannot read it: " in err and "internal error" not in err, err


def test_a_grammar_the_engine_panics_on_is_refused_without_the_panics_backtrace() -> None:
    # What llguidance says of a grammar of 70,000 rules (about 8 s to reach here, so the text is taken as it came):
    # the backtrace's frames reached the client's 400.
    said = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: <unknown>\n"
            "   1: <unknown>\n")
    assert compile_failure(said) == "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10"
    assert compile_failure("  lark: unknown rule 'x' at 3:1\n  ") == "lark: unknown rule 'x' at 3:1"
