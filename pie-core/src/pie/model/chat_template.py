"""Chat templates: the Jinja programs models ship to turn a conversation into a prompt.

Rendered the way transformers renders them (sandboxed, `trim_blocks`, `lstrip_blocks`, a
`raise_exception` helper and a `tojson` that leaves non-ASCII text alone) so that a model's
template produces the same prompt here as it does there.

A template is a program from a file, and a server renders it on every request, so each render
runs under `RenderLimits`. The compiled template counts a step for every loop iteration, call and
filter, and every piece of text it prints (in any frame: a macro's or a `{% set %}` block's
too); operations that can build a value far larger than their inputs (`*`, `**`, `+`, `%`,
padding widths, `round` precisions, `replace`, `translate`, `join`, indented JSON, wrapping long
words) are checked before they run, every value a call or filter returns after. The budget of a
render lives in a context variable, so renders on many threads at once are independent.
"""

from __future__ import annotations

import copy
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import cache, wraps
from string import Formatter
from types import TracebackType
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import loopcontrols
from jinja2.runtime import LoopContext, Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError

MAX_TEMPLATE_CHARS = 1 << 17
"""The longest template source compiled: real ones run from a few hundred characters to about twenty
thousand, and compiling takes about a kilobyte of memory per character of dense template code."""

SAMPLE_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi. How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
)
"""What a model's template must render when the model is loaded (and so imported): the plainest
conversation a chat client sends, with no system message, which some templates refuse."""


@dataclass(frozen=True)
class RenderLimits:
    """What one render of a template may spend before it stops with `ChatTemplateError`."""

    max_steps: int = 1_000_000
    """Loop iterations, calls and filters, all together."""
    max_seconds: float = 2.0
    max_output: int = 1 << 22
    """The most characters a render prints in all, and the largest value it builds (characters and
    items, counted through nesting)."""


_MAX_INT_BITS = 1 << 16
_MAX_JSON_INDENT = 16


class _OutOfBudget(BaseException):
    """Raised through the template's own code: a BaseException, so no `except Exception` inside
    jinja or a filter can swallow it."""


class _Budget:
    __slots__ = ("limits", "steps_left", "printed_left", "deadline")

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.steps_left = limits.max_steps
        self.printed_left = limits.max_output
        self.deadline = time.monotonic() + limits.max_seconds

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise _OutOfBudget(f"it took more than {self.limits.max_steps} steps (loop iterations, calls and filters)")
        if time.monotonic() > self.deadline:
            raise _OutOfBudget(f"it ran for more than {self.limits.max_seconds:g} s")

    def allow(self, size: float, what: str) -> None:
        """Refuse to build something of `size` characters or items."""
        if size > self.limits.max_output:
            raise _OutOfBudget(f"{what} would make a value of more than {self.limits.max_output} characters")


_BUDGET: ContextVar[_Budget] = ContextVar("pie_chat_template_budget")


def _budget() -> _Budget:
    budget = _BUDGET.get(None)
    if budget is None:  # jinja folding constants while it compiles: nothing of a template runs then
        raise nodes.Impossible()
    return budget


def _size(value: Any, limit: int) -> int:
    """About the characters `value` prints as: text by its length, integers by their digits, other
    scalars as 1, containers as their items added up (stopping once past `limit`)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, Namespace):  # what `namespace()` holds is printed with it
        value = value._Namespace__attrs  # type: ignore[attr-defined]
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        total = len(value)
        for item in value.items() if isinstance(value, dict) else value:
            total += _size(item, limit - total)
            if total > limit:
                break
        return total
    return 1


def _nesting(value: Any, depth: int = 0) -> int:
    """How deep containers nest in `value` (a walk as long as `_size`'s: values are checked with it first)."""
    if isinstance(value, dict):
        return max((_nesting(v, depth + 1) for v in value.values()), default=depth + 1)
    if isinstance(value, (list, tuple)):
        return max((_nesting(v, depth + 1) for v in value), default=depth + 1)
    return depth


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _printf_width(fmt: str) -> float:
    """The widest field a %-format asks for (a `*` width comes from the arguments: unbounded)."""
    widest = 0.0
    for match in _PRINTF_FIELD.finditer(fmt):
        for group in match.groups():
            if group == "*":
                return math.inf
            if group:
                widest = max(widest, int(group))
    return widest


def _format_width(fmt: str) -> float:
    """The widest field a str.format string asks for (a nested `{}` width: unbounded)."""
    widest = 0.0
    for _, _, spec, _ in Formatter().parse(fmt):
        if spec and "{" in spec:
            return math.inf
        widest = max([widest, *(int(n) for n in re.findall(r"\d+", spec or ""))])
    return widest


# --- Guards: what an operation would build, checked before it runs -----------------------------
# A guard takes the budget and the operation's arguments (for a str method, the string first),
# refuses what would be too large, and returns the arguments to call it with.

Guard = Callable[[_Budget, tuple[Any, ...], dict[str, Any], str], tuple[Any, ...]]


def _estimated(estimate: Callable[..., float]) -> Guard:
    """A guard from a function of the arguments giving the size of the result."""

    def guard(budget: _Budget, args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> tuple[Any, ...]:
        budget.allow(estimate(budget.limits.max_output, *args, **kwargs), what)
        return args

    return guard


def _measured(items: Any, separator: Any, budget: _Budget, what: str) -> Any:
    """The items to be joined, taken into a list and measured as they come."""
    if not isinstance(items, Iterable):
        return items
    separator_size = len(separator) if isinstance(separator, str) else 1
    total = 0
    taken = []
    for item in items:
        total += _size(item, budget.limits.max_output) + separator_size
        budget.allow(total, what)
        taken.append(item)
    return taken


def _join_method(budget: _Budget, args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> tuple[Any, ...]:
    if len(args) < 2:
        return args
    return (args[0], _measured(args[1], args[0], budget, what), *args[2:])


def _join_filter(budget: _Budget, args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> tuple[Any, ...]:
    if not args:  # (value, d="", attribute=None)
        return args
    separator = args[1] if len(args) > 1 else kwargs.get("d", "")
    return (_measured(args[0], separator, budget, what), *args[1:])


def _padded(limit: int, s: Any, width: Any = 0, *_: Any, **__: Any) -> float:
    return width if isinstance(width, int) else 0


def _expanded_tabs(limit: int, s: Any, tabsize: Any = 8, **__: Any) -> float:
    return len(s) + s.count("\t") * tabsize if isinstance(s, str) and isinstance(tabsize, int) else 0


def _replaced(limit: int, s: Any, old: Any = "", new: Any = "", count: Any = None, *_: Any) -> float:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    found = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(s) + found * max(len(new) - len(old), 0)


def _str_formatted(limit: int, s: Any, *_: Any, **__: Any) -> float:
    return len(s) + _format_width(s) if isinstance(s, str) else 0


def _translated(limit: int, s: Any, table: Any = None, *_: Any) -> float:
    if not isinstance(s, str):
        return 0
    entries = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
    return len(s) * max((len(entry) for entry in entries if isinstance(entry, str)), default=1)


_METHOD_GUARDS: dict[str, Guard] = {
    "center": _estimated(_padded), "ljust": _estimated(_padded), "rjust": _estimated(_padded),
    "zfill": _estimated(_padded), "expandtabs": _estimated(_expanded_tabs), "replace": _estimated(_replaced),
    "format": _estimated(_str_formatted), "format_map": _estimated(_str_formatted), "join": _join_method,
    "translate": _estimated(_translated),
}
"""str methods whose result can dwarf the string (arguments: the string, then the method's)."""


def _indented(limit: int, s: Any, width: Any = 4, *_: Any, **__: Any) -> float:
    if not isinstance(s, str):
        return 0
    indent = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(s) + (s.count("\n") + 1) * indent


def _wrapped(limit: int, s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
             *_: Any, **__: Any) -> float:
    if not isinstance(s, str) or not isinstance(width, int) or width < 1:
        return 0
    return len(s) + (len(s) // width + 1) * len(wrapstring if isinstance(wrapstring, str) else "\n")


_MAX_WRAP_COPIES = 10**9
_WRAP_WHITESPACE = re.escape("\t\n\x0b\x0c\r ")
"""What textwrap splits words at (only ASCII whitespace)."""


def _wordwrap(budget: _Budget, args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> tuple[Any, ...]:
    """Besides its result's size, the characters wrapping copies: for each line it breaks off a word longer than
    the width, textwrap copies what is left of the word, so a word of n characters costs n * n / (2 * width).
    Whitespace that starts a line (jinja wraps each line alone) is broken off the same way, a width at a time,
    and makes no line, so nothing drops it: each piece also strips what is left twice, three copies in all."""
    budget.allow(_wrapped(budget.limits.max_output, *args, **kwargs), what)
    s, width = (args[0] if args else None), (args[1] if len(args) > 1 else kwargs.get("width", 79))
    if isinstance(s, str) and isinstance(width, int) and 1 <= width < len(s):
        words = [word.end() - word.start() for word in re.finditer(f"[^{_WRAP_WHITESPACE}]{{{width + 1},}}", s)]
        leading = [len(line) - len(line.lstrip(" \t")) for line in s.splitlines()]
        copies = sum(n * n for n in words) + 3 * sum(n * n for n in leading if n > width)
        if copies / (2 * width) > _MAX_WRAP_COPIES:
            raise _OutOfBudget(f"{what} would copy more than {_MAX_WRAP_COPIES} characters (words or leading "
                               "whitespace far longer than its width)")
    return args


def _grouped(limit: int, value: Any, count: Any = 1, *_: Any, **__: Any) -> float:
    return count if isinstance(count, int) else 0


def _printf_formatted(limit: int, value: Any, *_: Any, **__: Any) -> float:
    return len(value) + _printf_width(value) if isinstance(value, str) else 0


def _json_sized(limit: int, value: Any, indent: Any = None, **__: Any) -> float:
    step = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    if step > _MAX_JSON_INDENT:
        return math.inf
    size = _size(value, limit)
    if not step or size > limit:
        return size
    return size * (1 + _nesting(value) * step)


def _pretty_sized(limit: int, value: Any, verbose: Any = False) -> float:
    size = _size(value, limit)
    return size if size > limit else size * (1 + _nesting(value))


def _summed(limit: int, iterable: Any, attribute: Any = None, start: Any = 0) -> float:
    # Adding up lists or strings is quadratic: only numbers are summed.
    return 0 if isinstance(start, (int, float)) and not isinstance(start, bool) else math.inf


def _rounded(limit: int, value: Any, precision: Any = 0, *_: Any, **__: Any) -> float:
    # Rounding computes 10 ** abs(precision), an integer as large as the operator '**' may make.
    if isinstance(precision, int) and abs(precision) * (10).bit_length() > _MAX_INT_BITS:
        return math.inf
    return 0


_FILTER_GUARDS: dict[str, Guard] = {
    "center": _estimated(_padded), "indent": _estimated(_indented), "wordwrap": _wordwrap,
    "replace": _estimated(_replaced),
    "join": _join_filter, "batch": _estimated(_grouped), "slice": _estimated(_grouped),
    "format": _estimated(_printf_formatted), "tojson": _estimated(_json_sized), "pprint": _estimated(_pretty_sized),
    "sum": _estimated(_summed), "round": _estimated(_rounded),
}
"""Filters whose result can dwarf their input (arguments as the template gives them: no context first)."""


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    guard = _FILTER_GUARDS.get(name)
    what = f"the filter '{name}'"
    passed = 0 if getattr(function, "jinja_pass_arg", None) is None else 1  # jinja's context, eval context or environment

    @wraps(function)  # keeps jinja's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        if guard is not None:
            args = (*args[:passed], *guard(budget, args[passed:], kwargs, what))
        return _checked(function(*args, **kwargs), budget, what)

    return bounded


def _checked(value: Any, budget: _Budget, what: str) -> Any:
    """`value`, once its whole size (through nesting) is known to be within the limit: no value
    too large to print, compare or serialize reaches the template."""
    if isinstance(value, str):
        budget.allow(len(value), what)
    elif isinstance(value, (list, tuple, set, frozenset, dict, Namespace)):
        budget.allow(_size(value, budget.limits.max_output), what)
    return value


def _binop_size(operator: str, left: Any, right: Any, limit: int) -> float:
    """What `left operator right` would build, for the operators that can outgrow their operands."""
    if operator == "*":
        for sequence, times in ((left, right), (right, left)):
            if isinstance(times, int) and isinstance(sequence, (str, list, tuple)):
                return _size(sequence, limit) * max(times, 0)
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            return math.inf
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if right * left.bit_length() > _MAX_INT_BITS:
                return math.inf
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            return _size(left, limit) + _size(right, limit)
    elif operator == "%" and isinstance(left, str):
        return len(left) + _printf_width(left)
    return 0


_BYTES_MAKERS = frozenset({"encode", "to_bytes"})
"""The methods (of str and int) that make bytes: no template needs bytes, and no guard measures them (`to_bytes`
allocates the length it is given, and bytes' `*` and padding methods are not checked), so they are refused."""


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with every loop's items counted and every printed text measured."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        counted = copy.copy(node)  # iterating `environment.counted(<the iterable>)`
        counted.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [node.iter], [], None, None,
                                  lineno=node.iter.lineno)
        super().visit_For(counted, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.built(")
        super().visit_Concat(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self.write("environment.built(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self.write("environment.built(")
        super().visit_Dict(node, frame)
        self.write(")")

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # an assignment's target, not a value
            super().visit_Tuple(node, frame)
            return
        self.write("environment.built(")
        super().visit_Tuple(node, frame)
        self.write(")")

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write("environment.printed(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")

    def _output_const_repr(self, group: Iterable[Any]) -> str:
        return f"environment.printed({super()._output_const_repr(group)})"


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: RenderLimits) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.max_output = limits.max_output
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        del self.globals["lipsum"]  # random text of any length a template asks for

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if attr in _BYTES_MAKERS and isinstance(obj, (str, int)):
            return False
        return super().is_safe_attribute(obj, attr, value)

    def counted(self, iterable: Iterable[Any]) -> Iterator[Any]:
        budget = _budget()
        for item in iterable:
            budget.step()
            yield item

    def built(self, value: Any) -> Any:
        """A value the template wrote out (`[...]`, `{...}`, `(...)`, `a ~ b`), once checked."""
        return _checked(value, _budget(), "a list, tuple, dict or text written here")

    def printed(self, text: str) -> str:
        budget = _budget()
        budget.printed_left -= len(text)
        if budget.printed_left < 0:
            raise _OutOfBudget(f"it printed more than {budget.limits.max_output} characters")
        return text

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        if isinstance(__obj, LoopContext) and args:  # `loop(children)` in a recursive loop
            args = (__self.counted(args[0]), *args[1:])
        # A bound method, or the sandbox's wrapper around str.format of one.
        receiver = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        guard = _METHOD_GUARDS.get(getattr(__obj, "__name__", "")) if isinstance(receiver, str) else None
        what = f"str.{__obj.__name__}" if guard is not None else "a call"
        if guard is not None:
            args = guard(budget, (receiver, *args), kwargs, what)[1:]
        return _checked(super().call(__context, __obj, *args, **kwargs), budget, what)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # most of what templates do: kept cheap
            if len(left) + len(right) > self.max_output:
                raise _OutOfBudget(f"the operator '+' would make a value of more than {self.max_output} characters")
            return left + right
        budget = _budget()
        budget.allow(_binop_size(operator, left, right, budget.limits.max_output), f"the operator '{operator}'")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@cache
def _environment(limits: RenderLimits) -> _BoundedEnvironment:
    """One environment for all templates of the same limits: what a render spends lives in its budget."""
    return _BoundedEnvironment(limits)


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates refer to."""

    @property
    def reserved_variables(self) -> frozenset[str]:
        """The variables a render sets itself, which a caller's may not name."""
        return frozenset({"messages", "add_generation_prompt", *self._special_tokens})

    def __init__(self, source: str, special_tokens: Mapping[str, str | None],
                 limits: RenderLimits = RenderLimits()) -> None:
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"chat template is {len(source)} characters; at most {MAX_TEMPLATE_CHARS} "
                                    "are compiled")
        try:
            self._template = _environment(limits).from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc
        except Exception as exc:  # e.g. nesting deeper than Python compiles
            raise ChatTemplateError(f"chat template does not compile: {type(exc).__name__}: {exc}") from exc
        self.source = source
        self.limits = limits
        self._special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               variables: Mapping[str, Any] | None = None) -> str:
        """The conversation as prompt text; ``variables`` are more of the template's variables (a caller's
        ``chat_template_kwargs``, such as Qwen3's ``enable_thinking``), never in place of the ones set here."""
        token = _BUDGET.set(_Budget(self.limits))
        try:
            context = self._template.new_context({**(variables or {}), "messages": list(messages),
                                                  "add_generation_prompt": add_generation_prompt,
                                                  **self._special_tokens})
            return "".join(self._template.root_render_func(context))
        except _OutOfBudget as exc:
            raise ChatTemplateError(f"chat template stopped{self._line(exc.__traceback__)}: {exc}") from None
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"chat template rejected the conversation{self._line(exc.__traceback__)}: {exc}") from exc
        except Exception as exc:  # a template is a program: anything it does wrong is its own error
            raise ChatTemplateError(
                f"chat template failed{self._line(exc.__traceback__)}: {type(exc).__name__}: {exc}") from exc
        finally:
            _BUDGET.reset(token)

    def _line(self, traceback: TracebackType | None) -> str:
        """' at line N' for the template line the error came from, if the traceback passes through it."""
        line = None
        while traceback is not None:
            if traceback.tb_frame.f_code.co_filename == "<template>":
                line = self._template.get_corresponding_lineno(traceback.tb_lineno)
            traceback = traceback.tb_next
        return "" if line is None else f" at line {line}"


def check_renders(render: Callable[[Sequence[Mapping[str, Any]]], str]) -> None:
    """Render `SAMPLE_CONVERSATION` with `render` (a template's `render`, a tokenizer's
    `apply_chat_template`); a `ChatTemplateError` that says so if it fails."""
    try:
        render(SAMPLE_CONVERSATION)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"{exc} (rendering a sample conversation: user, assistant, user)") from exc
