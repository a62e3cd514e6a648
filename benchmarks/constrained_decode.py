"""Constrained decoding: decode tokens/s with a JSON-schema constraint against without, and the grammar engines.

    python benchmarks/constrained_decode.py [--concurrency 1,32] [--tokens 64] [--runs 3] [--llama-server PATH]
    python benchmarks/constrained_decode.py --compare-engines [--samples 3]

Serving (the default): `pie serve` on the CPU engine with SmolLM2-135M (the embedded Q4_1 GGUF, run in
float32), streaming chat completions from the official `openai` client, greedy, each request exactly
`--tokens` tokens (`ignore_eos`; the schema, a list of at least 20 records, is never complete before
that, so constrained and free requests make the same tokens' worth of work). Each load: N clients, 2N
requests (at least 4), distinct prompts. Per load: decode tokens/s (1 / the median time per output
token after the first, and for N > 1 the aggregate of all tokens over the load's wall time) and time
to the first token. The free and the constrained loads alternate (ABBA across runs); the ratio is the
median of the runs' ratios. With `--llama-server` (or LLAMA_SERVER) the same loads, the same request
bodies (`response_format` json_schema, which llama.cpp's server turns into its own grammar), run against
llama.cpp's server on an F32 GGUF of the same weights (`--llama-gguf`, or one its `llama-quantize` writes).

`--compare-engines`: llguidance against xgrammar on SmolLM2's vocabulary (49152 tokens) over the fifty
schemas of pie-core/tests/generation/json_schemas.py, without a model: each step draws random logits
(favouring short ASCII tokens, so strings end), masks them, takes the argmax and advances. Per engine:
the vocabulary's build time, compile time per schema, the engine's time per token to compute the mask
and advance past the token (median, mean, p99; unpacking and applying the mask is timed apart),
which schemas it refuses, and which give an output that `jsonschema` (with its format checker) rejects.
xgrammar is not a pie dependency (it pulls torch and triton); install it beside, without its
dependencies: `pip install --target /tmp/xgr --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2`
and `PYTHONPATH=/tmp/xgr` (torch must be importable).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
SCHEMA_FILE = HERE.parent / "pie-core" / "tests" / "generation" / "json_schemas.py"

RECORDS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 16},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "city", "member"],
        "additionalProperties": False,
    },
    "minItems": 20,
}
"""Never complete in fewer than about 300 tokens: every request makes exactly --tokens tokens."""

NAMES = "Maria Ahmed Chen Olga Pedro Yuki Amara Lars Priya Tomas Ines Kofi".split()
CITIES = "Lisbon Cairo Osaka Lyon Lima Oslo Pune Accra Quito Riga Bergen Turin".split()


def prompt_text(index: int) -> str:
    people = [f"{NAMES[(index + i) % len(NAMES)]} ({20 + (index * 7 + i * 5) % 50}, "
              f"{CITIES[(index * 3 + i) % len(CITIES)]})" for i in range(4)]
    return f"Request {index}. List these people as JSON records with name, age, city, member: {', '.join(people)}."


# -- serving ---------------------------------------------------------------------------


@dataclass
class Load:
    tpot: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    failures: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "decode": 1 / statistics.median(self.tpot) if self.tpot else float("nan"),
            "aggregate": self.tokens / self.wall if self.wall else float("nan"),
            "ttft": statistics.median(self.ttft) if self.ttft else float("nan"),
            "failures": float(len(self.failures)),
        }


async def run_load(base_url: str, clients: int, requests: int, tokens: int, constrained: bool, offset: int) -> Load:
    import openai

    # Retries: a keep-alive connection the server closed fails before any token, and is simply sent again.
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=2, timeout=900)
    load = Load()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(offset + index)
    extra: dict[str, Any] = {}
    if constrained:
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "records", "schema": RECORDS}}

    async def one(index: int) -> None:
        start = time.perf_counter()
        stamps: list[float] = []
        made = 0
        text: list[str] = []
        stream = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt_text(index)}], max_tokens=tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, **extra)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                made = chunk.usage.completion_tokens
        if made != tokens or len(stamps) < 2:
            raise RuntimeError(f"request {index}: {made} tokens in {len(stamps)} chunks, wanted {tokens}")
        if constrained and not "".join(text).lstrip().startswith("["):
            raise RuntimeError(f"request {index}: the output does not follow the schema: {''.join(text)[:60]!r}")
        load.ttft.append(stamps[0] - start)
        load.tpot.append((stamps[-1] - stamps[0]) / (made - 1))
        load.tokens += made

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            try:
                await one(index)
            except Exception as exc:  # counted and shown, never hidden
                load.failures.append(f"{type(exc).__name__}: {exc}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    load.wall = time.perf_counter() - start
    await client.close()
    return load


def serving(args: argparse.Namespace) -> None:
    from serve_load import f32_copy, start_llama, start_pie

    from pie.model.store import resolve_model

    gguf = resolve_model(args.model)
    scratch = Path(tempfile.mkdtemp(prefix="constrained-"))
    servers = {"pie": start_pie(args.model)}
    if args.llama_server:
        f32 = Path(args.llama_gguf) if args.llama_gguf else f32_copy(
            str(Path(args.llama_server).with_name("llama-quantize")), gguf, scratch)
        servers["llama-server F32"] = start_llama(args.llama_server, f32)
    else:
        print("llama-server: not given (--llama-server or LLAMA_SERVER); pie alone")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    print(f"machine: {os.cpu_count()} CPUs; model {gguf.name}; {args.tokens} tokens a request; {args.runs} runs")
    try:
        rows = []
        for name, (_, url) in servers.items():
            asyncio.run(run_load(url, 1, 1, 8, True, offset=900_000))  # warm: compile, first masks
            for clients in concurrency:
                requests = max(2 * clients, 4)
                loads: dict[bool, list[Load]] = {False: [], True: []}
                for run in range(args.runs):
                    for constrained in ((False, True) if run % 2 == 0 else (True, False)):
                        offset = (run * 2 + constrained) * 10_000 + clients * 100
                        loads[constrained].append(asyncio.run(run_load(url, clients, requests, args.tokens,
                                                                       constrained, offset)))
                for runs in loads.values():
                    for load in runs:
                        for failure in load.failures[:3]:
                            print(f"  {name} failure: {failure}")
                free = [load.summary() for load in loads[False]]
                held = [load.summary() for load in loads[True]]
                failures = sum(s["failures"] for s in free + held)
                rows.append((name, clients, free, held, failures))
        print("\n| server, clients | decode tok/s free | with the schema | ratio (runs) | aggregate tok/s free / "
              "schema | ratio (runs) | TTFT p50 free / schema (s) | failures |")
        print("|---|---|---|---|---|---|---|---|")
        for name, clients, free, held, failures in rows:
            cells = [f"{name}, {clients}"]
            for key in ("decode", "aggregate"):
                ratios = [h[key] / f[key] for f, h in zip(free, held)]
                medians = [statistics.median(s[key] for s in runs) for runs in (free, held)]
                spread = f"{statistics.median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f})"
                cells += ([f"{medians[0]:.1f}", f"{medians[1]:.1f}", spread] if key == "decode" else
                          [f"{medians[0]:.1f} / {medians[1]:.1f}", spread])
            ttft = [statistics.median(s["ttft"] for s in runs) for runs in (free, held)]
            cells += [f"{ttft[0]:.2f} / {ttft[1]:.2f}", f"{failures:.0f}"]
            print("| " + " | ".join(cells) + " |")
    finally:
        for server, _ in servers.values():
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


# -- the grammar engines ---------------------------------------------------------------


def load_schemas() -> list[tuple[str, dict[str, Any]]]:
    spec = importlib.util.spec_from_file_location("json_schemas", SCHEMA_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SCHEMAS


def format_checker() -> Any:
    import jsonschema

    checker = jsonschema.FormatChecker()

    def rfc3339(text: str, with_date: bool) -> bool:
        value = text.replace("Z", "+00:00").replace("z", "+00:00").replace(":60", ":59")  # leap seconds are valid
        if with_date:
            date, sep, rest = value.partition("T" if "T" in value else "t")
            if not sep:
                return False
            datetime.date.fromisoformat(date)
            value = rest
        return datetime.time.fromisoformat(value).tzinfo is not None

    checker.checks("date-time", raises=ValueError)(lambda text: rfc3339(text, True))
    checker.checks("time", raises=ValueError)(lambda text: rfc3339(text, False))
    return checker


class Llguidance:
    """llguidance through its own API, synchronously (pie's Matcher computes the next mask in the background,
    which would hide it behind this loop's own work), with pie's vocabulary bridge and JSON style."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int):
        import llguidance

        from pie.generation.constraints import GrammarVocabulary

        self.llg = llguidance
        self.version = llguidance.__version__
        start = time.perf_counter()
        self.vocabulary = GrammarVocabulary(tokenizer, vocab)  # not the cached one: its build is timed
        self.setup_s = time.perf_counter() - start
        self.bits = np.zeros((vocab + 31) // 32, np.int32)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        from pie.generation.constraints import JSON_STYLE

        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
        matcher = self.llg.LLMatcher(self.vocabulary.engine, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any) -> np.ndarray:
        """The next token's mask, one bit a token (as uint8)."""
        matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return self.bits.view(np.uint8)

    def accept(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token} it allowed: {matcher.get_error()}")

    def finished(self, matcher: Any) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int):
        start = time.perf_counter()
        import xgrammar

        self.import_s = time.perf_counter() - start
        self.xgr = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        start = time.perf_counter()
        encoded = [""] * vocab
        for text, token in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            encoded[token] = text
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab,
                                      stop_token_ids=list(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info)
        self.setup_s = time.perf_counter() - start
        self.bits = xgrammar.allocate_token_bitmask(1, vocab)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any) -> np.ndarray:
        matcher.fill_next_token_bitmask(self.bits)
        return self.bits[0].numpy().view(np.uint8)

    def accept(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token} it allowed")

    def finished(self, matcher: Any) -> bool:
        return matcher.is_terminated()


def compare_engines(args: argparse.Namespace) -> None:
    import jsonschema

    from pie.model.loader import load_model
    from pie.model.store import resolve_model

    loaded = load_model(resolve_model(args.model))
    tokenizer, vocab = loaded.tokenizer, loaded.config.vocab_size
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in range(vocab)]
    short_ascii = np.array([len(p) <= 2 and p.isascii() for p in pieces]) * np.float32(6.0)
    schemas = load_schemas()
    checker = format_checker()
    engines: list[Any] = [Llguidance(tokenizer, vocab)]
    try:
        engines.append(Xgrammar(tokenizer, vocab))
    except ImportError as exc:
        print(f"xgrammar: not importable ({exc}); see --help for installing it beside")
    print(f"vocabulary: {vocab} tokens; {len(schemas)} schemas, {args.samples} samples each, at most "
          f"{args.max_tokens} tokens")
    for engine in engines:
        per_token: list[float] = []
        applying: list[float] = []
        compile_ms: list[float] = []
        refused: list[str] = []
        invalid: list[str] = []
        finished = total = 0
        for name, schema in schemas:
            try:
                start = time.perf_counter()
                compiled = engine.compile(schema)
                compile_ms.append((time.perf_counter() - start) * 1e3)
            except Exception as exc:  # the engine's own refusal, shown as it words it
                refused.append(f"{name} ({str(exc).splitlines()[0][:90]})")
                continue
            for sample in range(args.samples):
                total += 1
                rng = np.random.default_rng(sample)
                matcher = engine.matcher(compiled)
                out: list[int] = []
                ended = False
                for _ in range(args.max_tokens):
                    logits = rng.gumbel(size=vocab).astype(np.float32) + short_ascii
                    start = time.perf_counter()
                    bits = engine.fill(matcher)
                    filled = time.perf_counter()
                    allowed = np.unpackbits(bits, count=vocab, bitorder="little").view(np.bool_)
                    token = int(np.where(allowed, logits, np.float32(-np.inf)).argmax())
                    applied = time.perf_counter()
                    engine.accept(matcher, token)
                    per_token.append(filled - start + time.perf_counter() - applied)
                    applying.append(applied - filled)
                    if token in tokenizer.eos_token_ids or engine.finished(matcher):
                        ended = True
                        if token not in tokenizer.eos_token_ids:
                            out.append(token)
                        break
                    out.append(token)
                if not ended:
                    continue
                finished += 1
                text = tokenizer.decode(out)
                try:
                    jsonschema.Draft202012Validator(schema, format_checker=checker).validate(json.loads(text))
                except (ValueError, jsonschema.ValidationError) as exc:
                    invalid.append(f"{name}: {text[:50]!r} ({str(exc).splitlines()[0][:60]})")
        us = np.array(per_token) * 1e6
        extra = f", import {engine.import_s:.2f} s" if hasattr(engine, "import_s") else ""
        print(f"\n== {engine.name} {engine.version}: vocabulary {engine.setup_s:.2f} s{extra}")
        print(f"  compiled {len(schemas) - len(refused)}/{len(schemas)}; compile ms median "
              f"{statistics.median(compile_ms):.2f}, max {max(compile_ms):.1f}")
        print(f"  mask + advance per token: median {np.median(us):.1f} us, mean {us.mean():.1f}, "
              f"p99 {np.percentile(us, 99):.0f}, max {us.max():.0f} ({len(us)} tokens); applying the mask to the "
              f"logits (numpy, the same for both) median {np.median(applying) * 1e6:.1f} us")
        print(f"  finished {finished}/{total} samples; invalid finished outputs: {len(invalid)}")
        for line in refused:
            print(f"  refused: {line}")
        for line in invalid:
            print(f"  invalid: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model (default: the embedded SmolLM2 Q4_1 GGUF).")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    parser.add_argument("--llama-gguf", default=None, help="The F32 GGUF for llama-server (default: quantize one).")
    parser.add_argument("--compare-engines", action="store_true")
    parser.add_argument("--samples", type=int, default=3, help="--compare-engines: samples per schema")
    parser.add_argument("--max-tokens", type=int, default=200, help="--compare-engines: tokens per sample")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    compare_engines(args) if args.compare_engines else serving(args)


if __name__ == "__main__":
    main()
