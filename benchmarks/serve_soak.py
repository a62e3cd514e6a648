"""A bounded soak of `pie serve`: many concurrent `openai` clients doing a random mix, every response checked.

    python benchmarks/serve_soak.py [--seconds 300] [--clients 40] [--kv-tokens 512] [--host-kv-tokens 0]
                                    [--max-running 8] [--max-waiting 32] [--max-requests 100000] [--seed 0]

Serves the tiny random model of the serve tests (pie.testing.models.make_gguf_model, a 256-token context) on
127.0.0.1 with a small KV pool, so that sequences are preempted (recomputed, or swapped to the host pool with
--host-kv-tokens), and a small --max-running, so that requests wait. For --seconds, --clients async clients each
send one request after another, picked at random: chat and text completions, streamed or not, n 1..4, seeds,
log-probabilities, stop strings, json_schema and regex constraints, echo with max_tokens 0, prompts sharing
prefixes, prompts near the context's end (and just past it), clients that leave before their first token or
mid-stream, and invalid requests; /health, /metrics and /tokenize are polled meanwhile.

A finding is anything but a clean success or a well-formed OpenAI error JSON of the status expected: a 5xx, a
stream cut without an error event, a request that hangs past its timeout, usage that does not add up, a seeded
request (temperature > 0) whose output differs from the same request's before, a greedy request whose output under
load differs from the same request sent alone to the idle server afterwards. At the end, with no client connected:
requests_running, requests_waiting and kv_pages_used must be 0; the server's threads and open descriptors as at
the start (after a warm-up); its RSS must not keep growing (the second half's growth is compared to the first's);
--max-running + --max-waiting requests sent at once must all be taken (none counted in flight still).
Last, 20 requests of 150 tokens are in flight when the server gets SIGTERM (--drain-seconds 1): each must finish,
end with an error (a 503, a stream's error event) or find the server gone, and the server must exit 0. A line of
the server's log with a traceback or an ERROR is a finding too.

Prints a summary; exit status 1 when anything was found. Not a CI test: it runs for minutes on purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from pie.serve.app import LONG_TEXT
from pie.testing.models import make_gguf_model
from pie.testing.serve_process import ServeProcess

MODEL = "tiny"
CONTEXT = 256
REQUEST_TIMEOUT_S = 120.0
KEEP_ALIVE_S = 5.0
"""uvicorn's keep-alive timeout: a connection idle that long may be closed by the server as the client reuses it
(the poller's client, starved by the load, can idle that long)."""
WORDS = ("fox river pie cache page token model batch kernel layer paged stream engine device profile graph region "
         "sampler server client request answer question apple stone cloud seven green quiet").split()
PREFIXES = [" ".join(random.Random(i).choices(WORDS, k=60)) for i in range(4)]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"(yes|no)-[0-9]{1,3}"
INVALID: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"n": 0}), ("chat", {"temperature": -1}), ("chat", {"max_tokens": -3}), ("chat", {"top_p": 2}),
    ("chat", {"model": "no-such-model"}), ("chat", {"logprobs": True, "top_logprobs": 1000}),
    ("chat", {"response_format": {"type": "xml"}}), ("chat", {"extra_body": {"guided_regex": "("}}),
    ("chat", {"messages": []}), ("chat", {"max_tokens": 0}), ("completion", {"max_tokens": 0}),
    ("completion", {"prompt": [[999999]]}), ("completion", {"logprobs": 1000}), ("chat", {"seed": 2**70}),
    ("completion", {"prompt": "x " * 400, "max_tokens": 4}),
]


@dataclass
class Tally:
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    findings: list[str] = field(default_factory=list)
    seeded: dict[str, list[str]] = field(default_factory=dict)
    greedy: dict[str, tuple[str, dict[str, Any], list[str]]] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)

    lock: threading.Lock = field(default_factory=threading.Lock)
    """The poller's thread counts too."""

    def find(self, what: str) -> None:
        with self.lock:
            if len(self.findings) < 200:
                self.findings.append(what)

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


def logprob_tokens(choice: Any, kind: str) -> list[Any]:
    """The tokens a choice (or a streamed chunk of one) lists log-probabilities for."""
    if choice.logprobs is None:
        return []
    return (choice.logprobs.content or []) if kind == "chat" else (choice.logprobs.tokens or [])


def stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    return {"rss_kb": rss, "threads": threads, "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


def thread_names(pid: int) -> collections.Counter[str]:
    return collections.Counter((task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir())


def key_of(kind: str, kwargs: dict[str, Any]) -> str:
    """What makes two requests the same: everything but how the answer is sent."""
    same = {k: v for k, v in kwargs.items() if k not in ("stream", "stream_options")}
    return json.dumps([kind, same], sort_keys=True)


class Soak:
    def __init__(self, url: str, args: argparse.Namespace, long_ids: list[int]):
        self.url = url
        self.args = args
        self.long_ids = long_ids
        self.tally = Tally()
        self.deadline = 0.0
        self.sent = 0

    def client(self, timeout: float = REQUEST_TIMEOUT_S) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=timeout)

    # -- picking a request ---------------------------------------------------

    def template(self, rng: random.Random, pool: str, index: int) -> tuple[str, dict[str, Any]]:
        """A request fixed by (pool, index): seeded and greedy requests repeat, so that their outputs compare."""
        r = random.Random(f"{pool}{index}")
        kind = r.choice(["chat", "completion"])
        kwargs: dict[str, Any] = {"max_tokens": r.randint(1, 40), "n": r.randint(1, 4)}
        text = r.choice(PREFIXES)[: r.randint(20, 150)] + " " + words(r, r.randint(1, 10))
        if kind == "chat":
            kwargs["messages"] = [{"role": "user", "content": text}]
            if r.random() < 0.4:
                kwargs["logprobs"], kwargs["top_logprobs"] = True, r.randint(0, 5)
        else:
            kwargs["prompt"] = text
            if r.random() < 0.4:
                kwargs["logprobs"] = r.randint(0, 5)
        if pool == "seeded":
            kwargs["temperature"] = r.choice([0.7, 1.0, 1.5])
            kwargs["seed"] = r.randint(0, 2**31)
            kwargs["top_p"] = r.choice([1.0, 0.9])
        else:
            kwargs["temperature"] = 0
        if r.random() < 0.3:
            kwargs["stop"] = [r.choice(WORDS)[:3]]
        return kind, kwargs

    def pick(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        """(mode, kind, kwargs): mode says what is expected."""
        roll = rng.random()
        if roll < 0.2:
            kind, kwargs = self.template(rng, "seeded", rng.randrange(20))
            return "seeded", kind, kwargs
        if roll < 0.35:
            kind, kwargs = self.template(rng, "greedy", rng.randrange(20))
            return "greedy", kind, kwargs
        if roll < 0.45:
            kind, kwargs = self.template(rng, "seeded", rng.randrange(1000, 100000))
            if rng.random() < 0.5:
                kwargs.pop("seed")
            if kind == "chat":
                kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
            else:
                kwargs["extra_body"] = {"guided_regex": REGEX}
            kwargs.pop("stop", None)
            return "constrained", kind, kwargs
        if roll < 0.52:
            ids = self.long_ids[: rng.randint(CONTEXT - 60, CONTEXT - 1)]
            kwargs = {"prompt": ids, "echo": True, "max_tokens": 0, "n": rng.randint(1, 2),
                      "logprobs": rng.choice([None, 0, 3])}
            return "echo", "completion", kwargs
        if roll < 0.62:
            max_tokens = rng.randint(1, 30)
            over = rng.random() < 0.25
            length = CONTEXT - max_tokens + (rng.randint(1, 5) if over else -rng.randint(0, 3))
            kwargs = {"prompt": self.long_ids[:length], "max_tokens": max_tokens, "n": rng.randint(1, 3),
                      "temperature": rng.choice([0, 0.8]), "extra_body": {"ignore_eos": True}}
            return ("overlong" if over else "long"), "completion", kwargs
        if roll < 0.75:
            kind, kwargs = self.template(rng, "seeded", rng.randrange(1000, 100000))
            kwargs["max_tokens"] = rng.randint(20, 80)
            return rng.choice(["leave-early", "leave-mid"]), kind, kwargs
        if roll < 0.82:
            kind, extra = rng.choice(INVALID)
            _, kwargs = self.template(rng, "greedy", 0)
            base = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
            return "invalid", kind, {"max_tokens": 4, **base, **extra}
        kind, kwargs = self.template(rng, "seeded", rng.randrange(1000, 100000))
        if rng.random() < 0.5:
            kwargs.pop("seed")
        return "plain", kind, kwargs

    # -- sending and checking ------------------------------------------------

    async def call(self, client: openai.AsyncOpenAI, kind: str, kwargs: dict[str, Any]) -> Any:
        api = client.chat.completions if kind == "chat" else client.completions
        return await api.create(model=kwargs.pop("model", MODEL), **kwargs)

    async def one(self, rng: random.Random) -> None:
        mode, kind, kwargs = self.pick(rng)
        stream = mode == "leave-mid" or rng.random() < 0.5
        sent = {**kwargs, "stream": stream}
        if stream and rng.random() < 0.7:
            sent["stream_options"] = {"include_usage": True}
        self.tally.count(f"sent {mode}")
        timeout = rng.uniform(0.01, 3.0) if mode == "leave-early" else REQUEST_TIMEOUT_S
        try:
            async with self.client(timeout) as client:
                started = time.monotonic()
                result = await self.call(client, kind, dict(sent))
                if stream:
                    outcome = await self.read_stream(result, kind, sent, mode, rng)
                else:
                    outcome = self.read_whole(result, kind, sent)
        except openai.APITimeoutError:
            if mode == "leave-early":
                self.tally.count("left early")
            else:
                self.tally.find(f"hang: no answer within {REQUEST_TIMEOUT_S:g} s: {kind} {sent}")
            return
        except openai.APIStatusError as error:
            self.check_error(error, mode, kind, sent)
            return
        except openai.APIError as error:
            self.tally.find(f"{type(error).__name__} {error} after {time.monotonic() - started:.1f} s: {kind} {sent}")
            return
        if mode in ("invalid", "overlong"):
            self.tally.find(f"{mode} request answered with success: {kind} {sent}")
            return
        if outcome is None:
            return
        self.check_outcome(mode, kind, kwargs, sent, *outcome)

    def check_error(self, error: openai.APIStatusError, mode: str, kind: str, sent: dict[str, Any]) -> None:
        status = error.status_code
        try:
            body = error.response.json()
            ok_body = isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str)
        except Exception:  # noqa: BLE001 (a finding, whatever it is)
            ok_body = False
        if not ok_body:
            self.tally.find(f"{status} whose body is no OpenAI error: {error.response.text[:200]!r}: {kind} {sent}")
        elif status >= 500 and status != 503:
            self.tally.find(f"{status} {error.response.text[:300]}: {kind} {sent}")
        elif mode == "invalid" and status in (400, 404, 422):
            self.tally.count("refused as invalid")
        elif mode == "overlong" and status == 400:
            self.tally.count("refused as too long")
        elif status == 503 and body["error"].get("code") == "overloaded":  # a client that left, not yet noticed
            self.tally.count("refused as overloaded")
        else:
            self.tally.find(f"{status} {error.response.text[:300]} for a {mode} request: {kind} {sent}")

    def read_whole(self, result: Any, kind: str, sent: dict[str, Any]) -> tuple[list[str], list[str], Any, list[int]]:
        choices = sorted(result.choices, key=lambda c: c.index)
        texts = [(c.message.content or "") if kind == "chat" else c.text for c in choices]
        reasons = [c.finish_reason for c in choices]
        listed = [len(logprob_tokens(c, kind)) for c in choices]
        return texts, reasons, result.usage, listed

    async def read_stream(self, stream: Any, kind: str, sent: dict[str, Any], mode: str,
                          rng: random.Random) -> tuple[list[str], list[str], Any, list[int]] | None:
        texts: dict[int, str] = collections.defaultdict(str)
        reasons: dict[int, str] = {}
        listed: dict[int, int] = collections.Counter()
        usage = None
        leave_after = rng.randint(0, 6) if mode == "leave-mid" else -1
        chunks = 0
        async with stream:
            async for chunk in stream:
                if chunks == leave_after:
                    self.tally.count("left mid-stream")
                    return None
                chunks += 1
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    texts[choice.index] += (choice.delta.content or "") if kind == "chat" else choice.text
                    listed[choice.index] += len(logprob_tokens(choice, kind))
                    if choice.finish_reason is not None:
                        reasons[choice.index] = choice.finish_reason
        if mode == "leave-mid":
            self.tally.count("ended before leaving")
        n = sent.get("n", 1)
        if sorted(reasons) != list(range(n)):
            self.tally.find(f"stream ended without every choice's end (ends of {sorted(reasons)}, "
                            f"{chunks} chunks): {kind} {sent}")
            return None
        if sent.get("stream_options") and usage is None:
            self.tally.find(f"stream asked for usage and ended without it: {kind} {sent}")
        return [texts[i] for i in range(n)], [reasons[i] for i in range(n)], usage, [listed[i] for i in range(n)]

    def check_outcome(self, mode: str, kind: str, kwargs: dict[str, Any], sent: dict[str, Any], texts: list[str],
                      reasons: list[str], usage: Any, listed: list[int]) -> None:
        tally = self.tally
        tally.count(f"ok {mode}")
        n, max_tokens = sent.get("n", 1), sent["max_tokens"]
        if len(texts) != n:
            tally.find(f"{len(texts)} choices for n={n}: {kind} {sent}")
        if usage is not None:
            if usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
                tally.find(f"usage does not add up: {usage}: {kind} {sent}")
            if usage.completion_tokens > n * max_tokens:
                tally.find(f"usage {usage.completion_tokens} completion tokens over n*max_tokens: {kind} {sent}")
            if all(reason == "length" for reason in reasons) and usage.completion_tokens != n * max_tokens:
                tally.find(f"every choice ended by length, usage {usage.completion_tokens} != {n}*{max_tokens}: "
                           f"{kind} {sent}")
            if isinstance(sent.get("prompt"), list) and usage.prompt_tokens != len(sent["prompt"]):
                tally.find(f"usage {usage.prompt_tokens} prompt tokens for {len(sent['prompt'])} ids: {kind} {sent}")
            prompt_key = json.dumps([kind, sent.get("messages") or sent.get("prompt")])
            seen = tally.prompt_tokens.setdefault(prompt_key, usage.prompt_tokens)
            if seen != usage.prompt_tokens:
                tally.find(f"usage {usage.prompt_tokens} prompt tokens, {seen} before, same prompt: {kind} {sent}")
        wants_logprobs = (sent.get("logprobs") is not None and sent.get("logprobs") is not False)
        if wants_logprobs and not sent.get("echo"):
            for reason, count in zip(reasons, listed, strict=True):
                if reason == "length" and count != max_tokens:
                    tally.find(f"a choice ended by length listed {count} log-probabilities of {max_tokens}: "
                               f"{kind} {sent}")
        if mode == "constrained":
            for text, reason in zip(texts, reasons, strict=True):
                if reason != "stop":
                    continue
                if kind == "chat":
                    try:
                        value = json.loads(text)
                        assert set(value) == {"name", "age"}
                    except Exception:  # noqa: BLE001 (a finding, whatever it is)
                        tally.find(f"json_schema output {text!r} does not follow the schema: {sent}")
                elif not re.fullmatch(REGEX, text):
                    tally.find(f"guided_regex output {text!r} does not match: {sent}")
        if mode == "echo":
            for text in texts:
                if not text:
                    tally.find(f"echo with max_tokens 0 returned no prompt text: {sent}")
        if mode == "seeded":
            key = key_of(kind, kwargs)
            before = tally.seeded.setdefault(key, texts)
            if before is not texts:
                tally.count("seeded compared")
            if before != texts:
                tally.find(f"seeded request gave {texts!r}, before {before!r}: {kind} {kwargs}")
        if mode == "greedy":
            key = key_of(kind, kwargs)
            tally.greedy.setdefault(key, (kind, kwargs, texts))
            if tally.greedy[key][2] != texts:
                tally.find(f"greedy request gave {texts!r}, before {tally.greedy[key][2]!r}: {kind} {kwargs}")
            if tally.greedy[key][2] is not texts:
                tally.count("greedy compared")

    async def worker(self, number: int) -> None:
        rng = random.Random(self.args.seed * 1000 + number)
        while time.monotonic() < self.deadline and self.sent < self.args.max_requests:
            self.sent += 1
            try:
                await asyncio.wait_for(self.one(rng), REQUEST_TIMEOUT_S + 30)
            except TimeoutError:
                self.tally.find("hang: a request outlived its client's timeout by 30 s")
            except Exception as error:  # noqa: BLE001 (a finding, whatever it is)
                self.tally.find(f"the client raised {type(error).__name__}: {error}")

    async def poller(self) -> None:
        """/health, /metrics and /tokenize, one after another on one kept-alive connection, from a thread and event
        loop of their own: on the clients' loop, starved by them, a response could wait seconds to be read, and the
        connection idle past the server's keep-alive timeout unseen."""
        await asyncio.to_thread(asyncio.run, self.poll())

    async def poll(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            rng = random.Random(self.args.seed)
            answered = time.monotonic()
            while time.monotonic() < self.deadline:
                text = rng.choice(PREFIXES)[: rng.randint(0, 400)]
                for method, path, body in (("GET", "/health", None), ("GET", "/metrics", None),
                                           ("POST", "/tokenize", {"model": MODEL, "prompt": text})):
                    sent = time.monotonic()
                    try:
                        response = await http.request(method, path, json=body)
                    except httpx.HTTPError as error:
                        if sent - answered >= KEEP_ALIVE_S - 0.5:  # the server closes it as it is reused: a race
                            self.tally.count("polls that met the keep-alive timeout")
                            continue
                        self.tally.find(f"{method} {path}: {type(error).__name__} {error} (the connection idle "
                                        f"{sent - answered:.2f} s before, the error {time.monotonic() - sent:.2f} s "
                                        "after the request)")
                        continue
                    answered = time.monotonic()
                    self.tally.count(f"polled {path}")
                    if response.status_code != 200 or (body and response.json()["count"] != len(response.json()["tokens"])):
                        self.tally.find(f"{method} {path}: {response.status_code} {response.text[:200]}")
                await asyncio.sleep(0.2)

    async def raw_garbage(self) -> None:
        """Bodies that are no JSON, sent now and then (each on a connection of its own: a kept-alive one may meet the
        server's keep-alive timeout as it is reused): each must be a 400 with an error JSON."""
        while time.monotonic() < self.deadline:
            try:
                async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
                    response = await http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                                               headers={"content-type": "application/json"})
                if response.status_code != 400 or "error" not in response.json():
                    self.tally.find(f"a truncated JSON body: {response.status_code} {response.text[:200]}")
                self.tally.count("sent garbage")
            except httpx.HTTPError as error:
                self.tally.find(f"a truncated JSON body: {type(error).__name__} {error}")
            await asyncio.sleep(2)

    async def run(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        await asyncio.gather(self.poller(), self.raw_garbage(), *(self.worker(i) for i in range(self.args.clients)))

    async def capacity(self) -> None:
        """--max-running + --max-waiting requests at once to the idle server: each must be taken. A request the server
        still counted in flight after its end would make it refuse one as at capacity."""
        places = self.args.max_running + self.args.max_waiting

        async def one(index: int) -> None:
            async with self.client() as client:
                try:
                    await self.call(client, "completion", {"prompt": f"{index} fox", "max_tokens": 20})
                    self.tally.count("capacity probe taken")
                except openai.APIStatusError as error:
                    self.tally.find(f"{places} requests to the idle server: one answered {error.status_code} "
                                    f"{error.response.text[:300]}")

        await asyncio.gather(*(one(i) for i in range(places)))

    async def greedy_alone(self) -> None:
        """Each greedy request seen under load, sent again alone to the idle server."""
        async with self.client() as client:
            for kind, kwargs, texts in list(self.tally.greedy.values()):
                result = await self.call(client, kind, {**kwargs, "stream": False})
                alone = self.read_whole(result, kind, kwargs)[0]
                self.tally.count("greedy checked alone")
                if alone != texts:
                    self.tally.find(f"greedy request under load gave {texts!r}, alone {alone!r}: {kind} {kwargs}")


def idle_stats(server: ServeProcess, pid: int) -> dict[str, int]:
    """The server's threads and descriptors once idle: the HTTP thread pool's idle threads leave after 10 s, when
    the pool is next used (a /tokenize of a long text encodes there)."""
    time.sleep(11)
    for _ in range(3):
        httpx.post(f"{server.url}/tokenize", json={"prompt": "warm " * (LONG_TEXT // 4)}, timeout=30)
    time.sleep(1)
    return stats(pid)


async def drain(server: ServeProcess, clients: int = 20) -> collections.Counter[str]:
    """Streams and whole requests of 150 tokens in flight, then SIGTERM: each must finish, or end with an error (a
    503 or a stream's error event), or find the server gone; the server must exit 0 (--drain-seconds 1)."""
    outcomes: collections.Counter[str] = collections.Counter()
    started = asyncio.Event()

    async def one(index: int) -> None:
        stream = index % 2 == 0
        prompt = f"{index} " + words(random.Random(index), 20)
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=REQUEST_TIMEOUT_S) as client:
            try:
                result = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=150, stream=stream,
                                                         extra_body={"ignore_eos": True})
                if not stream:
                    outcomes["finished whole"] += 1
                    return
                reasons = set()
                async for chunk in result:
                    started.set()
                    reasons |= {choice.finish_reason for choice in chunk.choices} - {None}
                outcomes["streamed to its end" if reasons else "finding: a stream cut without an error event"] += 1
            except openai.APIStatusError as error:
                outcomes[f"answered {error.status_code}"] += 1
            except openai.APIConnectionError:
                outcomes["found the server gone"] += 1
            except openai.APIError as error:  # a stream's error event
                outcomes["stream ended by an error event" if "shut down" in str(error) else f"finding: {error}"] += 1
            except Exception as error:  # noqa: BLE001 (a finding, whatever it is)
                outcomes[f"finding: {type(error).__name__}: {error}"] += 1

    async def stop() -> int:
        await asyncio.wait_for(started.wait(), REQUEST_TIMEOUT_S)
        return await asyncio.to_thread(server.stop)

    *_, code = await asyncio.gather(*(one(i) for i in range(clients)), stop())
    outcomes["exit 0" if code == 0 else f"finding: pie serve exited {code}"] += 1
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--kv-tokens", type=int, default=512)
    parser.add_argument("--host-kv-tokens", type=int, default=0)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--max-waiting", type=int, default=32,
                        help="as small as the clients: requests left counted in flight show as refusals at the end")
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = make_gguf_model(Path(folder) / "tiny.gguf", "F32", lm_head_scale=20.0)
        options = ["--model", str(model), "--served-model-name", MODEL, "--kv-tokens", str(args.kv_tokens),
                   "--max-running", str(args.max_running), "--max-waiting", str(args.max_waiting), "--drain-seconds", "1"]
        if args.host_kv_tokens:
            options += ["--host-kv-tokens", str(args.host_kv_tokens)]
        with ServeProcess(*options) as server:
            server.wait_ready()
            return soak(server, args)


def soak(server: ServeProcess, args: argparse.Namespace) -> int:
    pid = server.process.pid
    long_text = " ".join(random.Random(7).choices(WORDS, k=400))
    long_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": long_text, "add_special_tokens": False},
                          timeout=30).json()["tokens"]
    assert len(long_ids) >= CONTEXT, len(long_ids)
    soaker = Soak(server.url, args, long_ids)
    asyncio.run(soaker.run(10))  # warm-up: every kind of request once at least, the grammar compiler, the pools
    warm_findings = len(soaker.tally.findings)
    start = idle_stats(server, pid)
    timeline: list[tuple[float, dict[str, int]]] = []

    async def sampled() -> None:
        began = time.monotonic()

        async def sample() -> None:
            while time.monotonic() < soaker.deadline:
                timeline.append((time.monotonic() - began, stats(pid)))
                await asyncio.sleep(5)

        await asyncio.gather(soaker.run(args.seconds), sample())

    began = time.monotonic()
    asyncio.run(sampled())
    wall = time.monotonic() - began
    end_metrics = server.metrics()
    end = idle_stats(server, pid)
    asyncio.run(soaker.greedy_alone())
    asyncio.run(soaker.capacity())
    tally = soaker.tally
    for name in ("pie:requests_running", "pie:requests_waiting", "pie:kv_pages_used"):
        if end_metrics.get(name) != 0:
            tally.find(f"with no client connected, {name} is {end_metrics.get(name)}")
    if end["threads"] > start["threads"]:
        tally.find(f"threads {start['threads']} at the start, {end['threads']} at the end: {thread_names(pid)}")
    if end["fds"] != start["fds"]:
        tally.find(f"open descriptors {start['fds']} at the start, {end['fds']} at the end")
    first = [sample["rss_kb"] for t, sample in timeline if t < wall / 2]
    second = [sample["rss_kb"] for t, sample in timeline if t >= wall / 2]
    first_growth = (max(first) - start["rss_kb"]) / 1024 if first else 0.0
    second_growth = (max(second) - max(first)) / 1024 if second and first else 0.0
    if second_growth > max(16.0, first_growth / 2):
        tally.find(f"RSS grew {first_growth:.1f} MiB in the first half, {second_growth:.1f} MiB in the second")

    drained = asyncio.run(drain(server))
    for what in drained:
        if what.startswith("finding"):
            tally.find(f"SIGTERM under load: {what}")

    print(f"soak: {wall:.0f} s, {args.clients} clients, --kv-tokens {args.kv_tokens} --host-kv-tokens "
          f"{args.host_kv_tokens} --max-running {args.max_running} --max-waiting {args.max_waiting}; {soaker.sent} requests "
          f"({warm_findings} findings in the warm-up)")
    for name, value in sorted(tally.counts.items()):
        print(f"  {name}: {value}")
    for name in ("pie:preemptions_total", "pie:preemption_recomputes_total", "pie:kv_pages_swapped_out_total",
                 "pie:kv_pages_swapped_in_total", "pie:kv_swap_failures_total", "pie:requests_cancelled_total",
                 "pie:prefix_cache_hits_total", "pie:scheduler_steps_total", "pie:kv_pages_cached",
                 "pie:requests_running", "pie:requests_waiting", "pie:kv_pages_used"):
        print(f"  {name}: {end_metrics.get(name)}")
    print(f"  server at the start (idle): {start}; at the end (idle): {end}")
    print(f"  RSS: {start['rss_kb'] / 1024:.1f} MiB at the start, +{first_growth:.1f} MiB over the first half, "
          f"+{second_growth:.1f} MiB over the second")
    print(f"  SIGTERM under load: {dict(sorted(drained.items()))}")
    print(f"findings: {len(tally.findings)}")
    for finding in tally.findings:
        print(f"  - {finding[:600]}")
    errors = [i for i, line in enumerate(server.lines) if "Traceback" in line or "ERROR" in line]
    if errors:
        print(f"server log: {len(errors)} error lines; from the first:\n{''.join(server.lines[errors[0]:])[:3000]}")
    return 1 if tally.findings or errors else 0


if __name__ == "__main__":
    sys.exit(main())
