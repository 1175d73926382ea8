"""Prompt templates over row columns, rendered in Jinja's sandbox (no Python objects reachable),
within a time limit and a size limit per row.

The sandbox keeps Python out of reach; the limits keep a template from spinning or from building
a prompt of gigabytes: output is produced piece by piece (`generate`) and measured as it grows,
every call, attribute access and intercepted operator checks the row's deadline, and operators
and filters refuse arguments that would build a value over the size limit before building it.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.sandbox import SandboxedEnvironment, SecurityError

from ..engine.errors import EMPTY_PROMPT, PROMPT_RENDER, BatchLLMError

PROMPT_TOO_LARGE = "prompt_too_large"
DEFAULT_RENDER_TIMEOUT_S = 1.0
CHARS_PER_TOKEN = 8  # a rendered prompt over 8 characters per token of the window cannot fit
_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\d+)|%[-#0 +]*\*?\.(\d+)")


class _TooLarge(SecurityError):
    pass


class _TooSlow(SecurityError):
    pass


class _Null(jinja2.StrictUndefined):
    """A NULL column: false in `{% if %}`, replaced by `| default(...)`, an error when printed."""

    def __bool__(self) -> bool:
        return False


_LIMITS = threading.local()  # this thread's render: .deadline (monotonic), .max_chars


def _check_time() -> None:
    deadline = getattr(_LIMITS, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _TooSlow("rendering took longer than its time limit")


def _check_size(value: Any) -> Any:
    limit = getattr(_LIMITS, "max_chars", None)
    if limit is not None and isinstance(value, str | list | tuple | bytes) and len(value) > limit:
        raise _TooLarge(f"a value of {len(value)} items is over the limit of {limit} characters")
    return value


def _check_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    limit = getattr(_LIMITS, "max_chars", None)
    if limit is None:
        return
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise _TooLarge(f"argument {value} is over the limit of {limit} characters")


def _bounded_filter(func: Any) -> Any:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_time()
        _check_args(args, kwargs)
        return _check_size(func(*args, **kwargs))

    return wrapper


class _BoundedEnvironment(SandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self) -> None:
        super().__init__(undefined=jinja2.StrictUndefined, autoescape=False)
        for name, func in list(self.filters.items()):
            wrapped = _bounded_filter(func)
            for marker in ("jinja_pass_arg",):  # keep pass_context / pass_environment
                if hasattr(func, marker):
                    setattr(wrapped, marker, getattr(func, marker))
            self.filters[name] = wrapped

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        limit = getattr(_LIMITS, "max_chars", None)
        if limit is not None:
            _precheck(operator, left, right, limit)
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_time()
        _check_args(args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_time()
        return super().getitem(obj, argument)


def _precheck(operator: str, left: Any, right: Any, limit: int) -> None:
    """Refuse an operation whose result would be over the limit, before computing it."""
    seq = (str, list, tuple, bytes)
    if operator == "*":
        n, times = (left, right) if isinstance(left, seq) else (right, left)
        if isinstance(n, seq) and isinstance(times, int) and len(n) * times > limit:
            raise _TooLarge(f"repeating {len(n)} items {times} times is over {limit} characters")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if abs(left) > 1 and right * math.log2(abs(left)) > 8 * limit:
            raise _TooLarge(f"{left} ** {right} is over {limit} characters")
    elif operator == "%" and isinstance(left, str):
        widths = [int(w) for m in _FORMAT_WIDTH.findall(left) for w in m if w]
        if any(w > limit for w in widths):
            raise _TooLarge(f"a format width is over {limit} characters")


_ENV = _BoundedEnvironment()


class _Watchdog:
    """The hard stop for a loop that calls nothing the sandbox can check (`{% for a in x %}{% for
    b in x %}{% endfor %}{% endfor %}`): past a render's deadline (plus a grace), a daemon thread
    raises _TooSlow inside the rendering thread, at its next Python instruction."""

    GRACE_S = 0.05

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: dict[int, float] = {}
        self.thread: threading.Thread | None = None

    def watch(self, deadline: float) -> None:
        with self.lock:
            self.active[threading.get_ident()] = deadline
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="render-watchdog", daemon=True
                )
                self.thread.start()

    def unwatch(self) -> None:
        with self.lock:
            self.active.pop(threading.get_ident(), None)

    def _run(self) -> None:
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            with self.lock:
                for ident, deadline in list(self.active.items()):
                    if now > deadline + self.GRACE_S:
                        del self.active[ident]
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(ident), ctypes.py_object(_TooSlow)
                        )


_WATCHDOG = _Watchdog()


class PromptError(BatchLLMError):
    """A prompt template that cannot work: malformed, naming an unknown column, or failing
    every row."""


@dataclass(frozen=True)
class Prompt:
    """`template` (user message) and optional `system`, both Jinja over the row's columns."""

    template: str
    system: str | None = None

    def variables(self) -> set[str]:
        names: set[str] = set()
        for label, text in (("template", self.template), ("system", self.system)):
            if text is None:
                continue
            if not isinstance(text, str) or (label == "template" and not text.strip()):
                raise PromptError(description=f"Prompt {label} must be a non-empty string.")
            try:
                ast = _ENV.parse(text)
            except jinja2.TemplateSyntaxError as exc:
                raise PromptError(
                    description=f"Malformed prompt {label} (line {exc.lineno}): {exc.message}"
                ) from None
            if any(ast.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends))):
                raise PromptError(
                    description=f"Prompt {label} may not include, import or extend other "
                    "templates: a prompt sees only its row's columns."
                )
            names |= meta.find_undeclared_variables(ast)
        return names


class CompiledPrompt:
    """A checked prompt, ready to render rows into chat messages within its limits."""

    def __init__(
        self,
        prompt: Prompt,
        columns: tuple[str, ...],
        *,
        render_timeout_s: float = DEFAULT_RENDER_TIMEOUT_S,
        max_prompt_chars: int | None = None,
    ) -> None:
        used = prompt.variables()
        unknown = sorted(used - set(columns))
        if unknown:
            raise PromptError(
                description=f"Prompt uses unknown column(s) {unknown}; the source provides "
                f"{sorted(columns)}."
            )
        if not render_timeout_s > 0:
            raise PromptError(description=f"render_timeout_s must be > 0, got {render_timeout_s}")
        if max_prompt_chars is not None and max_prompt_chars < 1:
            raise PromptError(description=f"max_prompt_chars must be >= 1, got {max_prompt_chars}")
        self.prompt = prompt
        self.used = tuple(sorted(used))
        self.render_timeout_s = render_timeout_s
        self.max_prompt_chars = max_prompt_chars
        self._user = _ENV.from_string(prompt.template)
        self._system = _ENV.from_string(prompt.system) if prompt.system else None
        # Most prompts are text with `{{ column }}` holes: those are filled without Jinja's
        # machinery (the same output, a fifth of the time); anything else renders in the sandbox.
        self._user_plan = _plan(prompt.template)
        self._system_plan = _plan(prompt.system) if prompt.system else None

    @property
    def plain(self) -> bool:
        """Text with `{{ column }}` holes only: rendering is linear in the row's size and cannot
        spin, so it may run on the event loop."""
        return self._user_plan is not None and (
            self._system is None or self._system_plan is not None
        )

    def max_chars_for(self, context_window: int | None) -> int | None:
        """The size limit: the setting, else CHARS_PER_TOKEN per token of the model's window."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_TOKEN * context_window if context_window else None

    def render(
        self, row: dict[str, Any], *, max_chars: int | None = None
    ) -> tuple[list[dict[str, str]] | None, tuple[str, str] | None]:
        """(messages, None), or (None, (error class, reason)) for a row that must not be sent."""
        limit = max_chars if max_chars is not None else self.max_prompt_chars
        if self.plain:
            fast = self._render_plain(row, limit)
            if fast is not None:
                return fast
        nulls = [c for c in self.used if row.get(c) is None]
        # Bytes (a BLOB column, a mis-declared encoding) are text with bad bytes replaced.
        values = {
            k: v.decode("utf-8", "replace") if isinstance(v, bytes) else v for k, v in row.items()
        }
        for c in nulls:
            values[c] = _Null(name=c)
        _LIMITS.deadline = deadline = time.monotonic() + self.render_timeout_s
        _LIMITS.max_chars = limit
        try:
            try:
                _WATCHDOG.watch(deadline)
                user = _generate(self._user, values, limit)
                messages = []
                if self._system is not None:
                    system = _generate(self._system, values, limit and limit - len(user))
                    messages.append({"role": "system", "content": system})
            finally:
                _WATCHDOG.unwatch()  # a stop raised just before this lands in the except below
        except _TooLarge as exc:
            return None, (PROMPT_TOO_LARGE, f"prompt is too large ({exc}); not tokenized")
        except _TooSlow:
            return None, (
                PROMPT_RENDER,
                f"prompt rendering took over {self.render_timeout_s:g} s; stopped",
            )
        except jinja2.UndefinedError as exc:
            if nulls:
                return None, _null_problem(nulls)
            return None, (PROMPT_RENDER, f"prompt could not be rendered: {exc}")
        except MemoryError:
            return None, (PROMPT_TOO_LARGE, "prompt is too large (out of memory); not tokenized")
        except Exception as exc:  # the sandbox's SecurityError, bad filters, type errors
            return None, (PROMPT_RENDER, f"prompt could not be rendered: {exc}")
        finally:
            _LIMITS.deadline = None
            _LIMITS.max_chars = None
        if not user.strip():
            return None, (EMPTY_PROMPT, "rendered prompt is empty")
        messages.append({"role": "user", "content": user})
        return messages, None

    def _render_plain(
        self, row: dict[str, Any], limit: int | None
    ) -> tuple[list[dict[str, str]] | None, tuple[str, str] | None] | None:
        """The plain-template path of `render`, or None to take the sandbox's (a value that is
        not a plain scalar, whose printing is Jinja's business)."""
        out = []
        size = 0
        for plan in (self._system_plan, self._user_plan):
            if plan is None:
                continue
            parts = []
            for piece in plan:
                if type(piece) is str:
                    parts.append(piece)
                    continue
                value = row.get(piece.name, _MISSING)
                if value is None:
                    nulls = [c for c in self.used if row.get(c) is None]
                    return None, _null_problem(nulls)
                kind = type(value)
                if kind is bytes:
                    value = value.decode("utf-8", "replace")
                elif kind not in _PLAIN:
                    return None  # Markup, __html__, undefined: let Jinja print it
                parts.append(value if kind is str else str(value))
            size += sum(map(len, parts))
            if limit is not None and size > limit:
                return None, (
                    PROMPT_TOO_LARGE,
                    f"prompt is too large (over {limit} characters); not tokenized",
                )
            out.append("".join(parts))
        if not out[-1].strip():
            return None, (EMPTY_PROMPT, "rendered prompt is empty")
        if len(out) == 2:
            return [
                {"role": "system", "content": out[0]},
                {"role": "user", "content": out[1]},
            ], None
        return [{"role": "user", "content": out[0]}], None


_MISSING = object()
_PLAIN = frozenset({str, bytes, int, float, bool})


def _null_problem(nulls: list[str]) -> tuple[str, str]:
    return (
        EMPTY_PROMPT,
        f"column(s) {nulls} are NULL and the template prints them as they are "
        "(handle NULLs in the template with {% if %} or | default(''))",
    )


def _plan(text: str) -> tuple[str | nodes.Name, ...] | None:
    """The template as literal text and bare column names, or None if it is anything more."""
    out: list[str | nodes.Name] = []
    for node in _ENV.parse(text).body:
        if not isinstance(node, nodes.Output):
            return None
        for child in node.nodes:
            if isinstance(child, nodes.TemplateData):
                out.append(child.data)
            elif isinstance(child, nodes.Name) and child.ctx == "load":
                out.append(child)
            else:
                return None
    return tuple(out)


def _generate(template: jinja2.Template, values: dict[str, Any], limit: int | None) -> str:
    """Render piece by piece, stopping as soon as the output is over the size or time limit."""
    parts: list[str] = []
    size = 0
    for piece in template.generate(values):
        size += len(piece)
        if limit is not None and size > limit:
            raise _TooLarge(f"over {limit} characters")
        _check_time()
        parts.append(piece)
    return "".join(parts)
