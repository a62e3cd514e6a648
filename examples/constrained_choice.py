"""Constrained choice: answer with exactly one of the given options, the one the model finds likeliest.

The prompt is computed once; each option is scored in a fork of it (sharing the
prompt's pages) by the log-probability of all its tokens, every option in the
same batched forward pass. A completion API can only sample free text and hope
it matches an option, or send one scoring request per option.

    pie run --inferlet examples/constrained_choice.py -- "Is the sky blue? Answer:" --option " yes" --option " no"
"""

from __future__ import annotations

import argparse
import asyncio


def parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="constrained_choice", description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--option", action="append", required=True, help="a possible answer (repeat)")
    return parser.parse_args(args)


async def main(ctx, args):
    opts = parse(args)
    prompt = ctx.context(opts.prompt)
    await prompt.flush()

    async def score(option):
        fork = prompt.fork()
        logprobs = await fork.logprobs(ctx.tokenize(option, special=False))
        fork.drop()
        return float(logprobs.sum())

    scores = await asyncio.gather(*(score(option) for option in opts.option))
    best = max(range(len(scores)), key=scores.__getitem__)
    return {
        "choice": opts.option[best],
        "logprobs": dict(zip(opts.option, scores, strict=True)),
        "prompt_tokens": prompt.tokens,
    }
