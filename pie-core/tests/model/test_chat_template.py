"""Chat templates render as jinja renders them, within bounds, on many threads at once."""

from __future__ import annotations

import threading

import jinja2
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pie.model import ChatTemplateError
from pie.model.chat_template import MAX_TEMPLATE_CHARS, SAMPLE_CONVERSATION, ChatTemplate, RenderLimits, check_renders
from pie.testing.models import CHAT_TEMPLATE

TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi {{ there }} %s"},
    {"role": "assistant", "content": "Hello.", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
    {"role": "user", "content": "Bye ß ü"},
]

# Templates that use what a loop, a macro or a call block can do, so the counted loops and
# measured output are seen to change nothing.
SAME_AS_JINJA = [
    CHAT_TEMPLATE,
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}{{ loop.cycle('a', 'b') }}"
    "{% if loop.changed(m.role) %}*{% endif %}{{ m.content }}{% else %}none{% endfor %}",
    "{% for m in messages if m.role != 'system' %}[{{ m.role }}]{% endfor %}",
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role }}{% continue %}x{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}{% endfor %}{{ ns.n }}",
    "{% macro show(m) %}<{{ m.role }}:{{ caller() if caller else m.content }}>{% endmacro %}"
    "{% for m in messages %}{{ show(m) }}{% call show(m) %}{{ m.content|upper }}{% endcall %}{% endfor %}",
    "{% for m in [{'c': [{'c': []}, {'c': [{'c': []}]}]}] recursive %}({{ loop.depth }}{{ loop(m.c) }}){% endfor %}",
    "{{ messages|map(attribute='role')|join(', ') }} {{ messages|selectattr('role', 'eq', 'user')|list|length }}"
    " {{ messages[2].tool_calls|tojson }} {{ messages[-1].content.split()|reverse|join('-') }}"
    " {{ '%-6s|' % 'ab' }}{{ '{:>5}'.format(7) }}{{ 'x'.center(5) }}{{ 'a\nb'|indent(2, true) }}",
    "{% set parts %}{% for m in messages %}{{ m.role[0] }}{% endfor %}{% endset %}{{ parts * 2 }}{{ [1, 2] + [3] }}"
    "{{ (1, 2) }}{{ 2 ** 10 }}{{ messages|batch(3)|list|length }}{{ range(4)|sum }}",
    "{% filter upper %}{% for m in messages %}{{ m.content }}{% endfor %}{% endfilter %}",
]


def _jinja(source: str) -> str:
    """The same template rendered by plain jinja, configured as transformers configures it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: __import__("json").dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(source).render(messages=CONVERSATION, add_generation_prompt=True, **TOKENS)


@pytest.mark.parametrize("source", SAME_AS_JINJA)
def test_renders_what_jinja_renders(source: str) -> None:
    assert ChatTemplate(source, TOKENS).render(CONVERSATION) == _jinja(source)


SMALL = RenderLimits(max_steps=1000, max_seconds=10.0, max_output=10_000)


@pytest.mark.parametrize("source,fragment", [
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
     "it took more than 1000 steps (loop iterations, calls and filters)"),
    ("{% for x in [1, 2] recursive %}{{ loop([1, 2]) }}{% endfor %}", "maximum recursion depth"),
    ("{% for x in range(10) recursive %}{% if loop.depth < 5 %}{{ loop(range(10)) }}{% endif %}{% endfor %}",
     "it took more than 1000 steps"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
     "it took more than 1000 steps"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "failed at line 1: RecursionError"),
    ("{{ messages|map('string')|map('upper')|list|length }}{% for i in range(999) %}{{ i|string }}{% endfor %}",
     "it took more than 1000 steps"),
    ("{% for i in range(100) %}{{ 'x' * 1000 }}{% endfor %}", "it printed more than 10000 characters"),
    ("{% set s %}{% for i in range(100) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}",
     "it printed more than 10000 characters"),
    ("{% macro m() %}{% for i in range(100) %}" + "z" * 500 + "{% endfor %}{% endmacro %}{% set x = m() %}",
     "it printed more than 10000 characters"),
    ("{{ 'x' * 10**10 }}", "the operator '*' would make a value of more than 10000 characters"),
    ("{{ [messages] * 100 }}", "the operator '*' would make a value of more than"),
    ("{{ 7 ** 100000 }}", "the operator '**' would make a value"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a list, tuple, dict or text written here would make a value of more than 10000 characters"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "the operator '+' would make a value"),
    ("{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x }}",
     "a list, tuple, dict or text written here would make a value"),
    ("{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = dict(a=ns.x, b=ns.x) %}{% endfor %}",
     "a call would make a value"),
    ("{% set ns = namespace(x=['ab']) %}{% for i in range(60) %}{% set n = namespace(a=ns.x, b=ns.x) %}"
     "{% set ns.x = [n] %}{% endfor %}", "would make a value"),
    ("{{ 'x'|center(10**9) }}", "the filter 'center' would make a value"),
    ("{{ 'x'.center(10**9) }}", "str.center would make a value"),
    ("{{ '1'.zfill(10**9) }}", "str.zfill would make a value"),
    ("{{ ('\t' * 100).expandtabs(1000) }}", "str.expandtabs would make a value"),
    ("{{ 'a'|indent(10**9, true) }}", "the filter 'indent' would make a value"),
    ("{% set s = 'a' * 1000 %}{{ s|replace('a', s) }}", "the filter 'replace' would make a value"),
    ("{% set s = 'a' * 1000 %}{{ s.replace('a', s) }}", "str.replace would make a value"),
    ("{% set s = 'a' * 1000 %}{{ range(100)|map('string')|join(s) }}", "the filter 'join' would make a value"),
    ("{% set s = 'a' * 1000 %}{{ s.join(range(100)|map('string')) }}", "str.join would make a value"),
    ("{% set s = 'a' * 1000 %}{{ s|wordwrap(1, wrapstring=s) }}", "the filter 'wordwrap' would make a value"),
    ("{{ '{:>1000000000}'.format(1) }}", "str.format would make a value"),
    ("{% set s = 'a' * 1000 %}{{ s.translate({97: s}) }}", "str.translate would make a value"),
    ("{% set s = 'a' * 100 %}{{ (s * 2).translate([s] * 98) }}", "str.translate would make a value"),
    ("{{ '{:>{w}}'.format(1, w=10) }}", "str.format would make a value"),
    ("{{ '%1000000000d' % 1 }}", "the operator '%' would make a value"),
    ("{{ '%*d' % (5, 1) }}", "the operator '%' would make a value"),
    ("{{ '%1000000000s'|format('x') }}", "the filter 'format' would make a value"),
    ("{{ [1]|batch(10**9, 0)|list }}", "the filter 'batch' would make a value"),
    ("{{ [1]|slice(10**9)|list }}", "the filter 'slice' would make a value"),
    ("{{ messages|tojson(indent=1000) }}", "the filter 'tojson' would make a value"),
    ("{{ ([[1]] * 10)|sum(start=[]) }}", "the filter 'sum' would make a value"),
    # `round` computes 10 ** |precision| in one call the budget cannot interrupt.
    ("{{ 5|round(-10**9) }}", "the filter 'round' would make a value"),
    ("{{ 5|round(precision=10**9, method='ceil') }}", "the filter 'round' would make a value"),
    # bytes, whose size no guard measures: 1 GB by one call, or by '*' on a small one.
    ("{{ (5).to_bytes(10**9, 'big')|length }}", "access to attribute 'to_bytes' of 'int' object is unsafe"),
    ("{{ ('x'.encode('utf-8') * 10**9)|length }}", "access to attribute 'encode' of 'str' object is unsafe"),
    ("{{ lipsum(10**8) }}", "'lipsum' is undefined"),
    ("{{ range(10**12)|list }}", "OverflowError: Range too big"),
    ("{{ messages.__class__.__mro__ }}", "rejected the conversation at line 1: access to attribute '__class__'"),
    ("{{ messages.append(1) }}", "rejected the conversation"),
    ("\n\n{{ messages[0].nope.deeper }}", "rejected the conversation at line 3: 'dict object' has no attribute 'nope'"),
    ("{{ messages + 1 }}", "failed at line 1: TypeError"),
    ("{{ 1 // 0 }}", "failed at line 1: ZeroDivisionError"),
    ("{{ 10 ** 5000 }}", "failed at line 1: ValueError: Exceeds the limit"),
    ("{% include 'other' %}", "failed at line 1: TypeError: no loader"),
    ("line one\n{{ raise_exception('no system messages, please') }}",
     "rejected the conversation at line 2: no system messages, please"),
])
def test_a_template_that_runs_away_or_fails_is_a_chat_template_error(source: str, fragment: str) -> None:
    template = ChatTemplate(source, TOKENS, SMALL)
    with pytest.raises(ChatTemplateError) as info:
        template.render(CONVERSATION)
    assert fragment in str(info.value)


def test_wordwrap_of_words_far_longer_than_its_width_is_refused_before_it_runs() -> None:
    # textwrap copies what is left of a long word for each line it breaks off: quadratic, in one call (28 s for
    # 1.5 million characters at width 1). Within the default size limits, so only the copying refuses it.
    wrapping = ChatTemplate("{{ ('a' * 300000)|wordwrap(1)|length }}", TOKENS)
    with pytest.raises(ChatTemplateError, match="the filter 'wordwrap' would copy more than 1000000000 characters"):
        wrapping.render(CONVERSATION)
    # A long word at a usual width, and a long text of short words at any, are wrapped.
    text = "word " * 20000 + "x" * 100000
    assert ChatTemplate("{{ text|wordwrap(80) }}", {"text": text}).render(CONVERSATION) == \
        _jinja_wordwrap(text, 80)
    assert len(ChatTemplate("{{ ('ab ' * 100000)|wordwrap(1)|length }}", TOKENS).render(CONVERSATION)) > 0



def test_wordwrap_of_leading_whitespace_far_longer_than_its_width_is_refused_before_it_runs() -> None:
    # Whitespace that starts a line is broken off a width at a time and, making no line, never dropped: quadratic
    # too (a render of 100,000 spaces at width 1 ran 10 s, past the 2 s limit, which is only checked between calls).
    for text in ("' ' * 100000", "'x\\n' ~ '\\t' * 100000 ~ 'x'"):
        wrapping = ChatTemplate(f"{{{{ ({text})|wordwrap(1)|length }}}}", TOKENS)
        with pytest.raises(ChatTemplateError, match="the filter 'wordwrap' would copy more than 1000000000 characters"):
            wrapping.render(CONVERSATION)
    # Whitespace after a word is dropped where it breaks: wrapped at any width.
    text = "word" + " " * 100000 + "x"
    assert ChatTemplate("{{ text|wordwrap(1) }}", {"text": text}).render(CONVERSATION) == _jinja_wordwrap(text, 1)


def _jinja_wordwrap(text: str, width: int) -> str:
    return jinja2.Environment().from_string("{{ text|wordwrap(width) }}").render(text=text, width=width)


def test_the_default_limits_stop_nested_loops() -> None:
    looping = ChatTemplate("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", TOKENS)
    with pytest.raises(ChatTemplateError, match="more than 1000000 steps"):
        looping.render(CONVERSATION)


def test_time_is_bounded_too() -> None:
    slow = ChatTemplate("{% for a in range(100000) %}{{ (range(100000)|list)|sort|length }}{% endfor %}", TOKENS,
                        RenderLimits(max_seconds=0.05))
    with pytest.raises(ChatTemplateError, match=r"it ran for more than 0.05 s"):
        slow.render(CONVERSATION)


@pytest.mark.parametrize("source,fragment", [
    ("{% for %}", "does not compile: Expected an expression"),
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not compile: RecursionError"),
    ("{% if true %}" * 200 + "x" + "{% endif %}" * 200, "does not compile"),
    ("x" * (MAX_TEMPLATE_CHARS + 1), f"is {MAX_TEMPLATE_CHARS + 1} characters; at most {MAX_TEMPLATE_CHARS}"),
])
def test_a_template_that_cannot_compile(source: str, fragment: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source, TOKENS)
    assert fragment in str(info.value)


def test_constants_are_not_evaluated_while_compiling() -> None:
    # A filter of constants that would exceed the limits fails when (and if) it runs, not at compile time.
    template = ChatTemplate("{% if messages %}ok{% else %}{{ 'x'|center(1000000000) }}{% endif %}", TOKENS)
    assert template.render(CONVERSATION) == "ok"
    with pytest.raises(ChatTemplateError, match="the filter 'center'"):
        template.render([])


def test_renders_on_many_threads_are_independent() -> None:
    # Each render takes 4 x 200 steps plus a few; with a budget of 1000 a shared budget would run out.
    steady = ChatTemplate("{% for m in messages %}{% for i in range(200) %}{% endfor %}{{ m.role }}{% endfor %}",
                          TOKENS, RenderLimits(max_steps=1000))
    looping = ChatTemplate("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                           TOKENS, RenderLimits(max_steps=200_000))
    expected = "systemuserassistantuser"
    outcomes: list[object] = []

    def render(template: ChatTemplate) -> None:
        for _ in range(20):
            try:
                outcomes.append(template.render(CONVERSATION))
            except ChatTemplateError as exc:
                outcomes.append(exc)

    threads = [threading.Thread(target=render, args=(looping if i % 4 == 0 else steady,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert outcomes.count(expected) == 6 * 20
    assert sum(isinstance(o, ChatTemplateError) and "200000 steps" in str(o) for o in outcomes) == 2 * 20


def test_check_renders_uses_the_sample_conversation() -> None:
    seen: list[object] = []
    check_renders(lambda messages: seen.append(messages) or "")
    assert seen == [SAMPLE_CONVERSATION]
    refusing = ChatTemplate("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}",
                            TOKENS)
    with pytest.raises(ChatTemplateError, match=r"system first \(rendering a sample conversation: user, assistant"):
        check_renders(refusing.render)


def test_jinja_errors_are_all_chat_template_errors() -> None:
    assert issubclass(ChatTemplateError, ValueError)
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate("{{ messages[0]['content'] | nosuchfilter }}", TOKENS)
    assert isinstance(info.value.__cause__, jinja2.TemplateError)
