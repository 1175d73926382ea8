"""Token estimation: tiktoken's count as OpenAI bills chat prompts, and the offline fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import tiktoken

from batch_llm_assets.engine.tokens import (
    count_prompt_tokens,
    encoding_for,
    requested_max_tokens,
)


def test_counts_follow_openais_chat_accounting():
    enc = tiktoken.get_encoding("o200k_base")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo wörld 👋 مرحبا", "name": "alice"},
    ]
    expected = 3  # reply priming
    for m in messages:
        expected += 3 + len(enc.encode(m["role"])) + len(enc.encode(m["content"]))
    expected += 1 + len(enc.encode("alice"))
    assert count_prompt_tokens(messages, "gpt-4o-mini") == expected
    # Special-token text in user data is counted as text, not refused.
    assert count_prompt_tokens([{"role": "user", "content": "<|endoftext|>"}], "gpt-4o") > 7


def test_encoding_per_model_with_fallbacks():
    assert encoding_for("gpt-4o-mini").name == "o200k_base"
    assert encoding_for("gpt-4").name == "cl100k_base"
    assert encoding_for("some-local-llama").name == "o200k_base"


def test_answer_budget():
    assert requested_max_tokens({"max_tokens": 7}, 256) == 7
    assert requested_max_tokens({"max_completion_tokens": 9}, 256) == 9
    assert requested_max_tokens({}, 256) == 256


def test_without_encoding_files_it_overestimates_from_characters_and_warns_once(tmp_path):
    # No cached files and no way to download them (a proxy that refuses): the real offline case.
    env = {
        **os.environ,
        "TIKTOKEN_CACHE_DIR": str(tmp_path),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
    }
    code = textwrap.dedent("""
        import logging
        logging.basicConfig(level=logging.WARNING)
        from batch_llm_assets.engine.tokens import count_prompt_tokens
        text = "The quick brown fox jumps over the lazy dog. " * 20
        print(count_prompt_tokens([{"role": "user", "content": text}], "gpt-4o-mini"))
        print(count_prompt_tokens([{"role": "user", "content": text}], "gpt-4o-mini"))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    first, second = (int(x) for x in proc.stdout.split())
    true_count = count_prompt_tokens(
        [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 20}],
        "gpt-4o-mini",
    )
    assert first == second >= true_count  # conservative: never under the real count
    assert proc.stderr.count("No tiktoken encoding could be loaded") == 1
