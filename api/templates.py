"""The sandbox synthesis templates render in, and what one render may cost.

Jinja2's immutable sandbox (no attribute of Python internals, no mutation of lists or
dicts) with strict undefined variables, plus limits (RenderLimits) checked wherever a
template can spend: every loop turn, call, filter, operator, concatenation, captured
block and output piece. A template that would build a 30 MB string, turn a loop a billion
times or recurse without end stops early with TemplateLimit saying which limit it passed,
before the memory or the time is spent.

    sandbox = BoundedSandbox(RenderLimits())
    text = sandbox.render(sandbox.compile_template(source), row)
"""

from __future__ import annotations

import math
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator
from functools import wraps
from typing import Any

from jinja2 import StrictUndefined, Template, TemplateError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer
from pydantic import BaseModel, ConfigDict, Field

LOOP_GUARD = "specq_loop_guard"  # the global every {% for %} iterates through
CONCAT_GUARD = "specq_concat_guard"  # the global every ~ concatenation becomes
MAX_ITEMS = 1_000_000  # items of a list or tuple a template may build
MAX_BITS = 100_000  # bits of an integer a template may build (about 30,000 digits)
MAX_LIPSUM_WORDS = 100_000
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class RenderLimits(BaseModel):
    """What rendering one seed row may cost; a spec may lower or raise each limit."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_chars: int = Field(100_000, ge=1, le=10_000_000, strict=True,
                           description="characters of the rendered text, and of any string "
                           "the template builds on the way")
    loop_turns: int = Field(1_000_000, ge=1, le=100_000_000, strict=True,
                            description="turns of all its loops together")
    seconds: float = Field(2.0, gt=0, le=600, description="seconds of rendering per row")


class TemplateLimit(TemplateError):
    """A render passed one of its RenderLimits; the message says which."""


class _Guards(NodeTransformer):
    """Every loop iterates through LOOP_GUARD, every ~ concatenation is CONCAT_GUARD."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = _call(LOOP_GUARD, [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return _call(CONCAT_GUARD, list(node.nodes), node.lineno)


def _call(name: str, args: list[Any], lineno: int) -> nodes.Call:
    call = nodes.Call(nodes.Name(name, "load"), args, [], None, None)
    call.set_lineno(lineno)
    return call


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose renders stop at ``limits`` (TemplateLimit). One instance
    renders one row at a time (it is not shared between threads)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: RenderLimits | None = None) -> None:
        super().__init__(undefined=StrictUndefined, autoescape=False,
                         keep_trailing_newline=True, finalize=self._piece)
        self.limits = limits or RenderLimits()
        self._deadline = math.inf
        self._turns = 0
        self.globals[LOOP_GUARD] = self._loop
        self.globals[CONCAT_GUARD] = self._concat
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}

    # -- compiling and rendering ------------------------------------------------------------

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Guards().visit(super()._parse(source, name, filename))

    def compile_template(self, source: str) -> Template:
        """``source`` compiled with the guards in place (TemplateSyntaxError when bad)."""
        return self.from_string(source)

    def render(self, template: Template, row: dict[str, Any]) -> str:
        """``template`` rendered over the columns of ``row``, within the limits."""
        self._deadline = time.monotonic() + self.limits.seconds
        self._turns = 0
        pieces: list[str] = []
        size = 0
        for piece in template.generate(row):
            size += len(piece)
            if size > self.limits.max_chars:
                raise TemplateLimit(f"rendered output exceeds {self.limits.max_chars} "
                                    f"characters")
            pieces.append(piece)
            self._clock()
        return "".join(pieces)

    # -- the checks -------------------------------------------------------------------------

    def _clock(self) -> None:
        if time.monotonic() > self._deadline:
            raise TemplateLimit(f"rendering took more than {self.limits.seconds:g} s")

    def _chars(self, n: int, what: str = "a string") -> None:
        if n > self.limits.max_chars:
            raise TemplateLimit(f"builds {what} of more than {self.limits.max_chars} "
                                f"characters")

    def _sized(self, value: Any) -> Any:
        """``value`` if it is within the limits (strings, sequences, integers)."""
        if isinstance(value, (str, bytes)):
            self._chars(len(value))
        elif isinstance(value, (list, tuple, dict)) and len(value) > MAX_ITEMS:
            raise TemplateLimit(f"builds a collection of more than {MAX_ITEMS} items")
        elif isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise TemplateLimit(f"builds a number of more than {MAX_BITS} bits")
        return value

    def _piece(self, value: Any) -> Any:
        """Every {{ output }}, in captured blocks and macros too."""
        self._clock()
        return self._sized(value)

    def _loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self._turns += 1
            if self._turns > self.limits.loop_turns:
                raise TemplateLimit(f"more than {self.limits.loop_turns} loop turns")
            self._clock()
            yield item

    def _concat(self, *parts: Any) -> str:
        texts = [str(p) for p in parts]
        self._chars(sum(map(len, texts)))
        return "".join(texts)

    def concat(self, pieces: Iterable[str]) -> str:
        """Joins captured blocks, macro bodies and whole renders (Jinja's own concat)."""
        pieces = list(pieces)
        self._chars(sum(map(len, pieces)))
        return "".join(pieces)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self._clock()
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
                self._sized_repeat(seq, n)
            elif isinstance(left, int) and isinstance(right, int):
                self._bits(left.bit_length() + right.bit_length())
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1:
                self._bits(left.bit_length() * right)
        elif operator == "+" and isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            self._chars(len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            self._printf(left)
        return self._sized(super().call_binop(context, operator, left, right))

    def _sized_repeat(self, seq: Any, n: int) -> None:
        if isinstance(seq, (str, bytes)):
            self._chars(len(seq) * max(n, 0))
        elif len(seq) * max(n, 0) > MAX_ITEMS:
            raise TemplateLimit(f"builds a collection of more than {MAX_ITEMS} items")

    def _bits(self, bits: int) -> None:
        if bits > MAX_BITS:
            raise TemplateLimit(f"builds a number of more than {MAX_BITS} bits")

    def _printf(self, fmt: str) -> None:
        """'%10000000d' pads before anything can be measured: refuse such widths."""
        for width, precision in _PRINTF_SPEC.findall(fmt):
            for n in (width, precision):
                if n == "*" or n and int(n) > self.limits.max_chars:
                    raise TemplateLimit(f"a format width or precision beyond "
                                        f"{self.limits.max_chars} characters")

    def _format_spec(self, fmt: str) -> None:
        """The same for '{:>10000000}'.format(x) (and nested '{:{}}' widths)."""
        for _, _, spec, _ in string.Formatter().parse(fmt):
            if spec and ("{" in spec or any(int(n) > self.limits.max_chars
                                            for n in re.findall(r"\d+", spec))):
                raise TemplateLimit(f"a format width or precision beyond "
                                    f"{self.limits.max_chars} characters")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            self._format_spec(value.__self__)
        return wrapped

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: B902
        # (the double underscores keep a template's own keyword arguments from clashing)
        __self._clock()
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, (str, bytes)):
            __self._method(owner, name, args, kwargs)
        elif isinstance(owner, int) and name == "to_bytes":
            length = args[0] if args else kwargs.get("length", 1)
            if isinstance(length, int):
                __self._chars(length, "bytes")
        elif name == "generate_lorem_ipsum":
            n, high = kwargs.get("n", args[0] if args else 5), kwargs.get("max", 100)
            if isinstance(n, int) and isinstance(high, int) and n * high > MAX_LIPSUM_WORDS:
                raise TemplateLimit(f"lipsum of more than {MAX_LIPSUM_WORDS} words")
        return __self._sized(super().call(__context, __obj, *args, **kwargs))

    def _method(self, text: str | bytes, name: str, args: tuple, kwargs: dict) -> None:
        """Pre-checks of the str and bytes methods whose result can dwarf their inputs."""
        if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
            self._chars(args[0])
        elif name == "expandtabs":
            size = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(size, int):
                tabs = text.count("\t") if isinstance(text, str) else text.count(b"\t")
                self._chars(len(text) + tabs * size)
        elif name == "replace" and len(args) >= 2:
            self._replace(text, *args[:3])
        elif name == "join" and args:
            self._join(text, args[0])
        elif name == "translate" and args and isinstance(args[0], dict):
            longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
            self._chars(len(text) * longest)

    def _replace(self, text: Any, old: Any, new: Any, count: Any = -1) -> None:
        if isinstance(old, type(text)) and isinstance(new, type(text)):
            hits = text.count(old)
            if isinstance(count, int) and count >= 0:
                hits = min(hits, count)
            self._chars(len(text) + hits * max(len(new) - len(old), 0))

    def _join(self, sep: Any, items: Any) -> None:
        if isinstance(items, (list, tuple)):
            self._chars(sum(len(x) if isinstance(x, (str, bytes)) else 1 for x in items)
                        + len(sep) * len(items))

    def _bounded_filter(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func`` with the clock, a pre-check of the filters that can grow their input
        (center, indent, format, replace, join, wordwrap, batch, slice) and a size check of
        its result."""
        skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

        @wraps(func)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self._clock()
            own = args[skip:]
            if name == "join" and own and not isinstance(own[0], (list, tuple, str)):
                args = (*args[:skip], list(self._loop(own[0])), *own[1:])
                own = args[skip:]
            self._filter_check(name, own, kwargs)
            return self._sized(func(*args, **kwargs))

        return bounded

    def _filter_check(self, name: str, args: tuple, kwargs: dict) -> None:
        value, rest = (args[0], args[1:]) if args else (None, ())

        def arg(i: int, key: str, default: Any) -> Any:
            return rest[i] if len(rest) > i else kwargs.get(key, default)

        if name == "center" and isinstance(arg(0, "width", 80), int):
            self._chars(arg(0, "width", 80))
        elif name == "indent" and isinstance(value, str):
            width = arg(0, "width", 4)
            width = len(width) if isinstance(width, str) else width
            if isinstance(width, int):
                self._chars(len(value) + (value.count("\n") + 1) * width)
        elif name == "format" and isinstance(value, str):
            self._printf(value)
        elif name == "replace" and isinstance(value, str):
            self._replace(value, arg(0, "old", None), arg(1, "new", None), arg(2, "count", -1))
        elif name == "join" and isinstance(value, (list, tuple)):
            sep = arg(0, "d", "")
            self._join(sep if isinstance(sep, str) else "", value)
        elif name == "wordwrap" and isinstance(value, str):
            wrap = arg(2, "wrapstring", None)
            if isinstance(wrap, str) and len(wrap) > 1:
                self._chars(len(value) * len(wrap))
        elif name in ("batch", "slice"):
            n = arg(0, "linecount" if name == "batch" else "slices", 1)
            if isinstance(n, int) and n > MAX_ITEMS:
                raise TemplateLimit(f"{name} into more than {MAX_ITEMS} parts")
