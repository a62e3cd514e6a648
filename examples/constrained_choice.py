"""Constrained choice: answer with exactly one of the given options, generated under a grammar.

The options become a grammar (``ctx.matcher(choice=...)``): at each step the model may only pick
a token that continues one of them, and the answer ends where an option is complete. Greedy by
default: one generation, as many forward passes as the answer has tokens, however many options
there are. With ``--samples N`` the computed prompt is forked N times (the forks share its pages),
each fork with its own copy of the matcher, each samples an answer, and the answers are counted:
the forks' tokens go through the batch scheduler together, one batched pass per step.

    pie run --inferlet examples/constrained_choice.py -- "Is the sky blue? Answer:" --option " yes" --option " no"
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter

from pie.generation import SamplingParams
from pie.inferlet import positive_int


def parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="constrained_choice", description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--option", action="append", required=True, help="a possible answer (repeat)")
    parser.add_argument("--samples", type=int, default=0, help="sample this many answers in forks and count them")
    parser.add_argument("--temperature", type=float, default=1.0, help="for --samples")
    parser.add_argument("--seed", type=int, default=0, help="for --samples")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="longest answer, in tokens")
    return parser.parse_args(args)


async def main(ctx, args):
    opts = parse(args)
    prompt = ctx.context(opts.prompt)
    prompt_tokens = prompt.tokens
    matcher = ctx.matcher(choice=opts.option)  # a bad option list is refused here, with the reason
    if opts.samples <= 0:
        tokens = await prompt.generate_tokens(opts.max_tokens, constraint=matcher)
        return {"choice": ctx.detokenize(tokens), "tokens": tokens, "prompt_tokens": prompt_tokens}
    await prompt.flush()

    async def sample(index):
        fork, own = prompt.fork(), matcher.fork()
        sampling = SamplingParams(temperature=opts.temperature, seed=opts.seed + index)
        answer = await fork.generate(opts.max_tokens, sampling=sampling, constraint=own)
        fork.drop()
        return answer

    answers = await asyncio.gather(*(sample(i) for i in range(opts.samples)))
    counts = Counter(answers)
    return {
        "choice": max(opts.option, key=lambda option: counts[option]),
        "counts": {option: counts[option] for option in opts.option},
        "answers": answers,
        "prompt_tokens": prompt_tokens,
    }
