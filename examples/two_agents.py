"""Two agents talk in turns; both continue one shared context of the common instructions.

The instructions are computed once and both agents' contexts are forks of it,
so that prefix lives in KV pages both hold. Each agent keeps its own history in
its cache: its own replies, and the other's replies filled in as user turns.
Nothing is recomputed between turns, where a stateless chat API would resend
and recompute the whole conversation at every turn. Written for ChatML chat
models (SmolLM2 and the like).

    pie run --inferlet examples/two_agents.py -- "whether tabs beat spaces" --turns 4
"""

from __future__ import annotations

import argparse

from pie.inferlet import positive_int

NAMES = ("Ada", "Bob")


def parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="two_agents", description=__doc__.splitlines()[0])
    parser.add_argument("topic")
    parser.add_argument("--turns", type=positive_int, default=4)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    return parser.parse_args(args)


def message(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


async def main(ctx, args):
    opts = parse(args)
    shared = ctx.context(message("system", f"{NAMES[0]} and {NAMES[1]} debate {opts.topic}. One short sentence each."))
    await shared.flush()
    agents = {name: shared.fork().fill(message("user", f"You are {name}.")) for name in NAMES}
    turns = []
    for turn in range(opts.turns):
        speaker, listener = NAMES[turn % 2], NAMES[(turn + 1) % 2]
        me = agents[speaker].fill("<|im_start|>assistant\n")
        before = me.tokens
        tokens = await me.generate_tokens(opts.max_tokens)
        me.fill("\n" if me.tokens[-1] in ctx.eos_token_ids else "<|im_end|>\n")
        reply = ctx.detokenize(tokens).strip()
        agents[listener].fill(message("user", f"{speaker}: {reply}"))
        turns.append({"speaker": speaker, "text": reply, "context_before": before, "tokens": tokens})
    return {
        "transcript": [f"{t['speaker']}: {t['text']}" for t in turns],
        "turns": turns,
        "shared_tokens": shared.tokens,
        # Both agents (and the shared context itself) hold the instructions' full pages.
        "shared_page_refcounts": [ctx.page_refcount(page) for page in shared.kv_pages()],
    }
