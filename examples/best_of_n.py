"""Best-of-n: sample n continuations of one prompt and keep the likeliest.

The prompt is computed once; its KV pages are then shared by the n forked
children (copy-on-write), and the n samplers run side by side, their forward
passes batched together. A completion API would send n requests and compute
(or at best cache-hit) the prompt n times.

    pie run --inferlet examples/best_of_n.py -- "Once upon a time" --n 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio

from pie.generation import Sampler, SamplingParams
from pie.inferlet import log_softmax, positive_int


def parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="best_of_n", description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--n", type=positive_int, default=4)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(args)


async def main(ctx, args):
    opts = parse(args)
    prompt = ctx.context(opts.prompt)
    await prompt.flush()
    children = [prompt.fork() for _ in range(opts.n)]

    async def sample(index, child):
        sampler = Sampler(SamplingParams(temperature=opts.temperature, seed=opts.seed + index))
        tokens, logprob = [], 0.0
        for _ in range(opts.max_tokens):
            logits = await child.next_logits()
            token = sampler.sample(logits)
            if token in ctx.eos_token_ids:
                break
            logprob += float(log_softmax(logits)[token])  # under the model, not the tempered sampler
            tokens.append(token)
            child.fill(tokens=[token])
        return {
            "text": ctx.detokenize(tokens),
            "tokens": tokens,
            "logprob": logprob,
            "mean_logprob": logprob / max(len(tokens), 1),
        }

    candidates = await asyncio.gather(*(sample(i, child) for i, child in enumerate(children)))
    best = max(range(opts.n), key=lambda i: candidates[i]["mean_logprob"])
    return {
        "best": candidates[best]["text"],
        "best_index": best,
        "candidates": candidates,
        "prompt_tokens": prompt.tokens,
        # How many contexts hold each of the prompt's pages once the children have generated:
        # full pages stay shared by all n + 1; a partly filled last page was copied by each child.
        "prompt_page_refcounts": [ctx.page_refcount(page) for page in prompt.kv_pages()],
    }
