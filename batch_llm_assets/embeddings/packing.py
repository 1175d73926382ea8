"""Many rows per request: a partition run's rows packed into embedding requests up to the
provider's limits (inputs per request, tokens per request, tokens per input; _constants.py cites
them), each row sized by the model's tokenizer first.

A row over the input limit fails `context_length` without being sent, or, with `truncate`, is
cut to its first max_input_tokens tokens (and marked truncated). A row alone over the limit any
one request may take (the LLM resource's tpm) fails `request_too_large`. Rows that failed before
sending (a NULL text, a template error) come out alone, as packs of one, for their result rows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..assets.prompt import CHARS_PER_TOKEN
from ..engine import cancel_and_wait
from ..engine import errors as E
from ..engine.tokens import count_text_tokens, encoding_for
from . import _constants as C


@dataclass(slots=True)
class EmbedItem:
    """One row to embed: its id, its text (None when it failed before sending: `error`)."""

    id: Any
    text: str | None
    error: tuple[str, str] | None = None
    tokens: int = 0
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class PackLimits:
    max_inputs: int
    max_tokens: int  # a pack's tokens: a row over it goes alone
    max_input_tokens: int
    truncate: bool = False
    ceiling: int | None = None  # a request's tokens at most (the provider's; the tpm)


def sized(item: EmbedItem, limits: PackLimits, model: str) -> EmbedItem:
    """The item with its tokens counted: cut (truncate) or failed when over a limit."""
    if item.error is not None or item.text is None:
        return item
    limit = limits.max_input_tokens
    text = item.text
    if limits.truncate and len(text) > CHARS_PER_TOKEN * limit:
        # A token covers at least one character: the first limit tokens of the text are those
        # of its first CHARS_PER_TOKEN x limit characters (the tokenizer never sees the rest).
        text, item.truncated = text[: CHARS_PER_TOKEN * limit], True
    n = count_text_tokens(text, model)
    if n > limit:
        if not limits.truncate:
            item.error = (
                E.CONTEXT_LENGTH,
                f"text is {n} tokens, over the model's input limit of {limit} tokens; not sent "
                "(set truncate to embed its first tokens)",
            )
            return item
        text, n = _cut(text, model, limit)
        item.truncated = True
    item.text, item.tokens = text, n
    if limits.ceiling is not None and n > limits.ceiling:
        item.error = (
            E.REQUEST_TOO_LARGE,
            f"text is {n} tokens, more than one request may carry ({limits.ceiling}: the "
            "tokens/min limit or max_tokens_per_request); not sent",
        )
    return item


def _cut(text: str, model: str, limit: int) -> tuple[str, int]:
    """The text's first `limit` tokens, as text, and its token count (decoding can merge or split
    a token at the cut: the count is taken again)."""
    enc = encoding_for(model)
    if enc is None:  # counted as UTF-8 bytes / 3: a character is at most one such token
        return text[:limit], min(limit, count_text_tokens(text[:limit], model))
    ids = enc.encode_ordinary(text)[:limit]
    while True:
        cut = enc.decode(ids, errors="ignore")
        n = count_text_tokens(cut, model)
        if n <= limit or not ids:
            return cut, n
        ids = ids[: limit - (n - limit)]


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


async def packs(
    items: AsyncIterable[EmbedItem], limits: PackLimits, model: str
) -> AsyncIterator[list[EmbedItem]]:
    """Packs of sized items, in order: a pack goes when the next row would break a limit, when
    the rows end, or when the next row takes over PACK_WAIT_S to come (see _constants.py).
    The rows are pulled by a task of their own into a bounded queue."""
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=max(1, limits.max_inputs))

    async def pull() -> None:
        try:
            async for item in items:
                await queue.put(item)
            await queue.put(_END)
        except Exception as exc:  # the reader failed: raised where the packs are taken
            await queue.put(_Failed(exc))

    puller = asyncio.create_task(pull())
    pack: list[EmbedItem] = []
    tokens = 0
    try:
        while True:
            if pack and queue.empty():
                try:
                    async with asyncio.timeout(C.PACK_WAIT_S):
                        got = await queue.get()
                except TimeoutError:
                    yield pack
                    pack, tokens = [], 0
                    continue
            else:
                got = await queue.get()
            if got is _END:
                break
            if isinstance(got, _Failed):
                if pack:  # the rows read before the failure still go
                    yield pack
                    pack = []
                raise got.exc
            item = sized(got, limits, model)
            if item.error is not None or item.tokens > limits.max_tokens:
                yield [item]  # failed before sending, or a pack of its own
                continue
            if pack and (
                len(pack) >= limits.max_inputs or tokens + item.tokens > limits.max_tokens
            ):
                yield pack
                pack, tokens = [], 0
            pack.append(item)
            tokens += item.tokens
        if pack:
            yield pack
    finally:
        await cancel_and_wait((puller,))
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
