"""Beam search: keep the `--beams` likeliest continuations, forking contexts as beams split.

Each surviving beam is a context forked from its parent, so beams share the KV
pages of their common prefix; the beams' forward passes run as one batch per
step. `--allow-ids` restricts the search to a few token ids through a custom
logit processor (the model's distribution renormalized over them).

    pie run --inferlet examples/beam_search.py -- "The answer is" --beams 4 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
from pie.inferlet import log_softmax, positive_int


def parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="beam_search", description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--beams", type=positive_int, default=4)
    parser.add_argument("--max-tokens", type=positive_int, default=8)
    parser.add_argument("--allow-ids", default="", help="comma-separated token ids the beams may use")
    return parser.parse_args(args)


def only(allowed: list[int]):
    def processor(logits, _tokens):
        masked = np.full_like(logits, -np.inf)
        masked[allowed] = logits[allowed]
        return masked

    return processor


async def main(ctx, args):
    opts = parse(args)
    processors = [only([int(t) for t in opts.allow_ids.split(",")])] if opts.allow_ids else []
    root = ctx.context(opts.prompt)
    beams = [(0.0, root, [])]  # (log-probability, context, generated tokens)
    for _ in range(opts.max_tokens):
        distributions = await asyncio.gather(*(beam.next_logits() for _, beam, _ in beams))
        candidates = []
        for index, ((score, _, _), logits) in enumerate(zip(beams, distributions, strict=True)):
            for processor in processors:
                logits = processor(logits, None)
            logprobs = log_softmax(logits)
            for token in np.argsort(-logprobs, kind="stable")[: opts.beams]:
                if np.isfinite(logprobs[token]):
                    candidates.append((score + float(logprobs[token]), index, int(token)))
        candidates.sort(key=lambda c: -c[0])
        survivors = []
        for score, index, token in candidates[: opts.beams]:
            _, parent, tokens = beams[index]
            survivors.append((score, parent.fork().fill(tokens=[token]), tokens + [token]))
        for _, parent, _ in beams:
            parent.drop()
        beams = survivors
    return {
        "best": ctx.detokenize(beams[0][2]),
        "beams": [{"tokens": tokens, "logprob": score, "text": ctx.detokenize(tokens)} for score, _, tokens in beams],
    }
