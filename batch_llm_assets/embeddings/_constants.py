"""Every tuning constant of the embedding assets, with the provider documents behind it.

OpenAI's create-embeddings reference (the `input` field of openai-python's
types/embedding_create_params.py): an input "must not exceed the max input tokens for the model
(8192 tokens for all embedding models), cannot be an empty string, and any array must be 2048
dimensions or less ... all embedding models enforce a maximum of 300,000 tokens summed across
all inputs in a single request". Azure OpenAI documents the same 2048 inputs per request.
OpenAI's Batch API: "/v1/embeddings batches are also restricted to a maximum of 50,000 embedding
inputs across all requests in the batch" (the batches reference, `endpoint`).
"""

from __future__ import annotations

MAX_INPUTS_PER_REQUEST = 2048
MAX_TOKENS_PER_REQUEST = 300_000
MAX_INPUT_TOKENS = 8192
BATCH_MAX_INPUTS = 50_000
# The longest vector any model here returns (text-embedding-3-large: 3072): a larger
# `dimensions` is a typo, refused before any run.
MAX_DIMENSIONS = 16_384
# Providers that take encoding_format base64 (OpenAI, Azure OpenAI, vLLM): vectors travel as
# little-endian float32, a quarter of the JSON (what the openai SDK asks for by default). Other
# servers are asked for floats.
BASE64_PROVIDERS = frozenset({"openai", "azure", "vllm"})
# Rows whose vectors may be in flight at once (sent, or answered and not yet handed to the
# writer): the senders are as many packs of max_inputs_per_request as this allows, at most the
# LLM resource's concurrency, and each waits for the writer's room before it sends. Bounds
# memory by rows, not by requests.
MAX_ROWS_IN_FLIGHT = 8192
# A pack carries at most this many seconds of the tokens/min limit: providers enforce a
# per-minute limit over short periods (Azure OpenAI "evaluates the rate of incoming requests
# over a small period of time, typically 1 or 10 seconds", learn.microsoft.com/azure/ai-services/
# openai/how-to/quota), and a request larger than such a period's share waits for an empty one
# (or gets a 429), however empty the minute. Packs of 10-token rows still carry 50 rows from a
# tpm of 60,000 up.
PACK_RATE_S = 0.5
# A pack waits at most this long for its next row: followers of its rows wait for their
# answers (assets/sharing.py pauses the reader at MAX_WAITING of them), so a pack that kept
# waiting for more rows could wait for itself.
PACK_WAIT_S = 0.25
