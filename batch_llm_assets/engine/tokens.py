"""Token estimation before sending, counted the way OpenAI counts chat prompts."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import Any

import tiktoken

log = logging.getLogger(__name__)

# OpenAI's accounting for chat messages: each message costs 3 tokens on top of its content,
# a `name` costs 1 more, and the reply is primed with 3 tokens.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3
_FALLBACK_ENCODINGS = ("o200k_base", "cl100k_base")


@functools.lru_cache(maxsize=32)
def encoding_for(model: str) -> tiktoken.Encoding | None:
    """tiktoken's encoding for the model, else o200k_base, else cl100k_base, else None.

    tiktoken fetches its files on first use (or reads TIKTOKEN_CACHE_DIR); when none can be
    loaded the caller falls back to a conservative character count, with one warning.
    """
    names: list[str] = []
    try:
        names.append(tiktoken.encoding_name_for_model(model))
    except KeyError:
        pass
    names.extend(n for n in _FALLBACK_ENCODINGS if n not in names)
    for name in names:
        try:
            return tiktoken.get_encoding(name)
        except Exception as exc:  # download refused, file missing or corrupt
            log.debug("tiktoken encoding %s unavailable: %s", name, exc)
    log.warning(
        "No tiktoken encoding could be loaded for model %r (set TIKTOKEN_CACHE_DIR to a folder "
        "holding the encoding files); estimating tokens from characters, conservatively.",
        model,
    )
    return None


@functools.lru_cache(maxsize=64)
def uses_fallback_encoding(model: str) -> bool:
    """True when tiktoken does not know the model: its counts are a guess (o200k for a Llama
    or Qwen tokenizer can be half the real count on digit-heavy text)."""
    try:
        tiktoken.encoding_name_for_model(model)
        return False
    except KeyError:
        return True


def count_text_tokens(text: str, model: str) -> int:
    enc = encoding_for(model)
    if enc is None:
        # Overestimates: at most 3 UTF-8 bytes per token holds for English, code and CJK.
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) / 3)
    # encode_ordinary = encode(disallowed_special=()): special-token text counts as text.
    return len(enc.encode_ordinary(text))


# Texts up to this many characters that repeat from row to row (roles, names, a system prompt,
# few-shot turns) are counted once: the BPE is most of the engine's own per-request cost.
_CACHED_TEXT_CHARS = 32_768


@functools.lru_cache(maxsize=256)
def _count_repeated(text: str, model: str) -> int:
    return count_text_tokens(text, model)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: count the text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def count_prompt_tokens(messages: Sequence[dict[str, Any]], model: str) -> int:
    """Prompt tokens of a chat request as OpenAI bills them.

    Every message but the last (the row's own) is counted through a small cache: those are
    the parts that repeat across rows."""
    total = REPLY_PRIMING
    last = len(messages) - 1
    for i, message in enumerate(messages):
        total += TOKENS_PER_MESSAGE + _count_repeated(message.get("role", ""), model)
        text = _content_text(message.get("content"))
        if i < last and len(text) <= _CACHED_TEXT_CHARS:
            total += _count_repeated(text, model)
        else:
            total += count_text_tokens(text, model)
        if message.get("name"):
            total += TOKENS_PER_NAME + _count_repeated(message["name"], model)
    return total


def requested_max_tokens(params: dict[str, Any], default: int) -> int:
    """The answer budget a request reserves: max_completion_tokens, max_tokens, or the default."""
    value = params.get("max_completion_tokens") or params.get("max_tokens")
    return int(value) if value else default
