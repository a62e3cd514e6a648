"""What an inferlet's ``main(ctx, args)`` receives as ``ctx``: the model's tokenizer and its contexts."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from pie.generation.constraints import CompiledGrammar, GrammarSpec, GrammarVocabulary, Matcher
from pie.inferlet.context import Context, ContextError
from pie.inferlet.wire import json_text
from pie.model.tokenizer import Tokenizer
from pie.scheduler.driver import Scheduler


class Session:
    """One running inferlet's handle on the runtime. Every context it opens is dropped when it ends."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        name: str = "inferlet",
        on_emit: Callable[[Any], None] | None = None,
    ):
        """``on_emit`` receives what the inferlet emits (served: an event of the run's stream); without it,
        emitted values are kept in ``emitted``."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.name = name
        self.emitted: list[Any] = []
        self._on_emit = on_emit if on_emit is not None else self.emitted.append
        self._contexts: dict[int, Context] = {}
        self._closed = False

    # -- text ----------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.scheduler.runner.config.vocab_size

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special`` adds the model's BOS (as a fresh prompt needs)."""
        if not isinstance(text, str):
            raise TypeError(f"the text to tokenize must be a str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the text holds {text[exc.start]!r} at index {exc.start}, which UTF-8 cannot encode") from None
        return self.tokenizer.encode(text, add_special_tokens=special)

    def detokenize(self, ids: Seq[int], *, skip_special: bool = True) -> str:
        return self.tokenizer.decode(self.token_ids(ids), skip_special_tokens=skip_special)

    def token_ids(self, tokens: Seq[int]) -> list[int]:
        """``tokens`` as ints, each checked to be an id of the model's vocabulary (an id of -1 would otherwise
        index the embedding from its end; one past it, read past it)."""
        vocab = self.vocab_size
        ids = []
        for token in tokens:
            try:
                value = operator.index(token)
            except TypeError:
                raise TypeError(f"token ids are integers, got {token!r}") from None
            if not 0 <= value < vocab:
                raise ValueError(f"token id {value} is outside the model's vocabulary (0 to {vocab - 1})")
            ids.append(value)
        return ids

    def chat_prompt(self, messages: Seq[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The model's chat template applied to ``[{"role": ..., "content": ...}, ...]``."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    # -- constrained output --------------------------------------------------

    def grammar(
        self,
        *,
        json_schema: Mapping[str, Any] | bool | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        choice: Seq[str] | None = None,
    ) -> CompiledGrammar:
        """One constraint compiled for this model's vocabulary (kept: compiling it again is free).

        Exactly one of: ``json_schema`` (a dict, or JSON text), ``regex`` (matched by the whole output),
        ``grammar`` (Lark, or llama.cpp's GBNF), ``choice`` (a list of strings). A bad one raises
        :class:`pie.generation.constraints.GrammarError`, saying what is wrong.
        """
        given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                                                 ("choice", choice)) if value is not None}
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex, grammar, choice (got {sorted(given) or 'none'})")
        ((name, value),) = given.items()
        if name == "json_schema":
            spec = GrammarSpec.json_schema(dict(value) if isinstance(value, Mapping) else value)
        else:
            spec = getattr(GrammarSpec, name)(value)
        return GrammarVocabulary.for_tokenizer(self.tokenizer, self.vocab_size).compile(spec)

    def matcher(
        self,
        *,
        json_schema: Mapping[str, Any] | bool | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        choice: Seq[str] | None = None,
    ) -> Matcher:
        """A matcher at the start of a constraint (see :meth:`grammar`), for token-at-a-time programs:
        ``await context.step(sampler, constraint=m)`` picks only tokens it allows; ``m.fork()`` copies it for a
        forked context; ``m.is_finished`` says the output is complete and nothing may follow."""
        return self.grammar(json_schema=json_schema, regex=regex, grammar=grammar, choice=choice).matcher()

    def emit(self, value: Any) -> None:
        """Send ``value`` (anything JSON can hold) to whoever runs the inferlet, as it happens: progress, partial
        answers. What ``main`` returns is the run's result."""
        try:
            json_text(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"emit takes values JSON can hold: {exc}") from None
        self._on_emit(value)

    # -- contexts ------------------------------------------------------------

    def context(self, text: str | None = None, *, tokens: Seq[int] | None = None, priority: int = 0) -> Context:
        """A new context, optionally filled with a prompt (``text`` gets the BOS token)."""
        if self._closed:
            raise ContextError(f"inferlet {self.name!r} has ended; it cannot open contexts")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority is a whole number (higher goes first), not {priority!r}")
        ctx = self._adopt(Context(self, self.scheduler.new_sequence(priority)))
        if text is not None:
            ctx.fill(tokens=self.tokenize(text))
        if tokens is not None:
            ctx.fill(tokens=tokens)
        return ctx

    def page_refcount(self, page: int) -> int:
        """How many contexts hold a device KV page (one a context's ``kv_pages()`` named). In-process the contexts of
        every inferlet count, which share one prefix cache; served, a run's contexts share pages only among
        themselves, and a page no context of the run holds is refused (ValueError)."""
        return self.scheduler.runner.pages.refcount(operator.index(page))

    @property
    def open_contexts(self) -> int:
        return len(self._contexts)

    def close(self) -> int:
        """Drop every context still open; returns how many there were."""
        self._closed = True
        contexts, self._contexts = list(self._contexts.values()), {}
        for ctx in contexts:
            ctx.drop()
        return len(contexts)

    def _adopt(self, ctx: Context) -> Context:
        if self._closed:
            ctx.drop()
            raise ContextError(f"inferlet {self.name!r} has ended; it cannot open contexts")
        self._contexts[id(ctx)] = ctx
        return ctx

    def _forget(self, ctx: Context) -> None:
        self._contexts.pop(id(ctx), None)
