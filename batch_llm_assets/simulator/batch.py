"""The simulator's Batch API: /v1/files and /v1/batches, with time compressed to seconds.

A batch is finished lazily: the first retrieve or list after `completion_s` answers its lines
(with the chat route's deterministic answers), so nothing runs in the background and a client
that dies while waiting finds its batch done when it comes back, as with a real provider.
Counters land in the simulator's /stats: files_uploaded, batches_created, batch_lines_submitted,
batch_lines_processed, batch_lines_failed, batches_retrieved, batches_rejected,
batches_cancelled, so tests can count resubmissions.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..engine.tokens import count_prompt_tokens
from .content import answer, structured_answer
from .embeddings import ENDPOINT as EMBEDDINGS
from .embeddings import batch_answer, line_tokens
from .structured import requested_schema

if TYPE_CHECKING:
    from .server import Simulator

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


@dataclass
class BatchSimConfig:
    """Batch settings, changeable through POST /admin/batch_config."""

    completion_s: float = 1.0  # simulated stand-in for the 24 h window: a batch ends this fast
    line_fail: float = 0.0  # fraction of lines answered with a 500 in the error file
    expire_fraction: float | None = None  # expire each batch with this fraction of lines done
    enqueued_token_limit: int | None = None  # per model, over batches not yet finished
    max_file_requests: int = 50_000
    max_file_bytes: int = 200 * 1024 * 1024


@dataclass
class _Batch:
    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any]
    model: str
    tokens: int
    total: int
    created_at: float
    status: str = "in_progress"
    errors: list[dict[str, Any]] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    finished_at: float | None = None
    completed: int = 0
    failed: int = 0

    def body(self) -> dict[str, Any]:
        done = self.finished_at if self.status in TERMINAL else None
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": int(self.created_at),
            "in_progress_at": int(self.created_at),
            "expires_at": int(self.created_at + 86_400),
            "completed_at": int(done) if done and self.status == "completed" else None,
            "failed_at": int(done) if done and self.status == "failed" else None,
            "expired_at": int(done) if done and self.status == "expired" else None,
            "cancelled_at": int(done) if done and self.status == "cancelled" else None,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=status)


class BatchAPI:
    """Files and batches of one simulator; answers come from the simulator's chat logic."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.config = BatchSimConfig()
        self.files: dict[str, tuple[str, bytes]] = {}  # id -> (purpose, content)
        self.file_times: dict[str, float] = {}  # id -> created_at
        self.batches: dict[str, _Batch] = {}

    def register(self, app: web.Application) -> None:
        for prefix in ("/v1", "/openai"):  # OpenAI's and Azure OpenAI's URL forms
            app.router.add_post(f"{prefix}/files", self.upload)
            app.router.add_get(f"{prefix}/files/{{file_id}}", self.file_info)
            app.router.add_get(f"{prefix}/files/{{file_id}}/content", self.content)
            app.router.add_post(f"{prefix}/batches", self.create)
            app.router.add_get(f"{prefix}/batches", self.list)
            app.router.add_get(f"{prefix}/batches/{{batch_id}}", self.retrieve)
            app.router.add_post(f"{prefix}/batches/{{batch_id}}/cancel", self.cancel)
        app.router.add_post("/admin/batch_config", self.set_config)

    async def set_config(self, request: web.Request) -> web.Response:
        updates = await request.json()
        unknown = set(updates) - {f.name for f in dataclasses.fields(BatchSimConfig)}
        if unknown:
            return _error(400, f"unknown batch settings: {sorted(unknown)}")
        self.config = dataclasses.replace(self.config, **updates)
        return web.json_response({"ok": True})

    # -- files -----------------------------------------------------------------------------
    async def upload(self, request: web.Request) -> web.Response:
        denied = self.sim.auth_error(request)
        if denied is not None:
            return denied
        purpose, content, name = None, b"", "upload.jsonl"
        async for part in await request.multipart():
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                name = part.filename or name
                content = bytes(await part.read())
        if purpose != "batch":
            return _error(400, f"purpose must be 'batch', got {purpose!r}")
        lines = [ln for ln in content.splitlines() if ln.strip()]
        cfg = self.config
        if len(lines) > cfg.max_file_requests or len(content) > cfg.max_file_bytes:
            return _error(
                400,
                f"file has {len(lines)} requests and {len(content)} bytes; the limits are "
                f"{cfg.max_file_requests} requests and {cfg.max_file_bytes} bytes",
                "file_too_large",
            )
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        self.files[file_id] = ("batch", content)
        self.file_times[file_id] = time.time()
        self.sim.counts["files_uploaded"] += 1
        return web.json_response(self._file_body(file_id, name))

    def _file_body(self, file_id: str, name: str = "upload.jsonl") -> dict[str, Any]:
        purpose, content = self.files[file_id]
        return {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(self.file_times.get(file_id, 0)),
            "filename": name,
            "purpose": purpose,
        }

    async def file_info(self, request: web.Request) -> web.Response:
        denied = self.sim.auth_error(request)
        if denied is not None:
            return denied
        file_id = request.match_info["file_id"]
        if file_id not in self.files:
            return _error(404, "No such file", "not_found")
        return web.json_response(self._file_body(file_id))

    async def content(self, request: web.Request) -> web.Response:
        denied = self.sim.auth_error(request)
        if denied is not None:
            return denied
        found = self.files.get(request.match_info["file_id"])
        if found is None:
            return _error(404, "No such file", "not_found")
        return web.Response(body=found[1], content_type="application/jsonl")

    # -- batches ---------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        denied = self.sim.auth_error(request)
        if denied is not None:
            return denied
        body = await request.json()
        found = self.files.get(body.get("input_file_id", ""))
        if found is None:
            return _error(400, f"input_file_id {body.get('input_file_id')!r} not found")
        if body.get("endpoint") not in ("/v1/chat/completions", EMBEDDINGS):
            return _error(400, f"unsupported endpoint {body.get('endpoint')!r}")
        lines = [json.loads(ln) for ln in found[1].splitlines() if ln.strip()]
        model = lines[0]["body"].get("model", "") if lines else ""
        tokens = sum(self._estimate(ln["body"], body["endpoint"]) for ln in lines)
        batch = _Batch(
            id=f"batch_{uuid.uuid4().hex[:24]}",
            input_file_id=body["input_file_id"],
            endpoint=body["endpoint"],
            completion_window=body.get("completion_window", "24h"),
            metadata=dict(body.get("metadata") or {}),
            model=model,
            tokens=tokens,
            total=len(lines),
            created_at=time.time(),
        )
        limit = self.config.enqueued_token_limit
        enqueued = sum(
            b.tokens for b in self.batches.values() if b.model == model and not self._finish(b)
        )
        self.batches[batch.id] = batch
        self.sim.counts["batches_created"] += 1
        if limit is not None and enqueued + tokens > limit:
            batch.status, batch.finished_at = "failed", time.time()
            batch.errors = [
                {
                    "code": "token_limit_exceeded",
                    "message": f"Enqueued token limit reached for {model}: {enqueued} enqueued "
                    f"+ {tokens} > {limit}.",
                    "line": None,
                    "param": None,
                }
            ]
            self.sim.counts["batches_rejected"] += 1
        else:
            self.sim.counts["batch_lines_submitted"] += len(lines)
        return web.json_response(batch.body())

    async def retrieve(self, request: web.Request) -> web.Response:
        denied = self.sim.auth_error(request)
        if denied is not None:
            return denied
        batch = self.batches.get(request.match_info["batch_id"])
        if batch is None:
            return _error(404, "No such batch", "not_found")
        self.sim.counts["batches_retrieved"] += 1
        self._finish(batch)
        return web.json_response(batch.body())

    async def list(self, request: web.Request) -> web.Response:
        denied = self.sim.auth_error(request)
        if denied is not None:
            return denied
        try:  # OpenAI's bounds: 1 to 100, default 20
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            return _error(400, "limit must be an integer")
        if not 1 <= limit <= 100:
            return _error(400, f"limit must be between 1 and 100, got {limit}")
        after = request.query.get("after")
        ordered = sorted(self.batches.values(), key=lambda b: b.created_at, reverse=True)
        if after:
            ids = [b.id for b in ordered]
            ordered = ordered[ids.index(after) + 1 :] if after in ids else []
        page = ordered[:limit]
        for batch in page:
            self._finish(batch)
        return web.json_response(
            {
                "object": "list",
                "data": [b.body() for b in page],
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None,
                "has_more": len(ordered) > limit,
            }
        )

    async def cancel(self, request: web.Request) -> web.Response:
        denied = self.sim.auth_error(request)
        if denied is not None:
            return denied
        batch = self.batches.get(request.match_info["batch_id"])
        if batch is None:
            return _error(404, "No such batch", "not_found")
        if not self._finish(batch):
            elapsed = time.time() - batch.created_at
            self._process(
                batch, "cancelled", min(1.0, elapsed / max(1e-9, self.config.completion_s))
            )
            self.sim.counts["batches_cancelled"] += 1
        return web.json_response(batch.body())

    # -- processing ------------------------------------------------------------------------
    def _estimate(self, body: dict[str, Any], endpoint: str) -> int:
        if endpoint == EMBEDDINGS:
            return line_tokens(self.sim.config, body)
        model = body.get("model", "")
        budget = body.get("max_completion_tokens") or body.get("max_tokens")
        budget = int(budget or self.sim.config.default_max_tokens)
        return count_prompt_tokens(body.get("messages") or [], model) + budget

    def _finish(self, batch: _Batch) -> bool:
        """True once the batch is terminal; finishes it when its (compressed) time is up."""
        if batch.status in TERMINAL:
            return True
        if time.time() - batch.created_at < self.config.completion_s:
            return False
        fraction = self.config.expire_fraction
        if fraction is None:
            self._process(batch, "completed", 1.0)
        else:
            self._process(batch, "expired", fraction)
        return True

    def _process(self, batch: _Batch, status: str, fraction: float) -> None:
        lines = [json.loads(ln) for ln in self.files[batch.input_file_id][1].splitlines() if ln]
        answered = round(len(lines) * fraction)
        out: list[dict[str, Any]] = []
        err: list[dict[str, Any]] = []
        for i, line in enumerate(lines):
            base = {"id": f"batch_req_{uuid.uuid4().hex[:20]}", "custom_id": line["custom_id"]}
            if i >= answered:  # never reached: the provider says so in the error file
                code = "batch_expired" if status == "expired" else "batch_cancelled"
                err.append(base | {"response": None, "error": {"code": code, "message": code}})
                continue
            self.sim.counts["batch_lines_processed"] += 1
            status_code, payload = self._answer(line["body"], batch.endpoint)
            record = base | {
                "response": {"status_code": status_code, "request_id": base["id"], "body": payload},
                "error": None,
            }
            (out if status_code == 200 else err).append(record)
        batch.completed = len(out)
        batch.failed = len(err) - (len(lines) - min(answered, len(lines)))
        batch.output_file_id = self._store(out)
        batch.error_file_id = self._store(err)
        batch.status, batch.finished_at = status, time.time()

    def _store(self, records: list[dict[str, Any]]) -> str | None:
        if not records:
            return None
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        self.files[file_id] = (
            "batch_output",
            b"".join(json.dumps(r).encode() + b"\n" for r in records),
        )
        return file_id

    def _answer(self, body: dict[str, Any], endpoint: str) -> tuple[int, dict[str, Any]]:
        sim = self.sim
        if endpoint == EMBEDDINGS:
            return batch_answer(sim, body)
        model = body.get("model", "")
        messages = body.get("messages") or []
        if model not in sim.config.models:
            return 404, {
                "error": {
                    "message": f"The model `{model}` does not exist.",
                    "type": "invalid_request_error",
                    "code": "model_not_found",
                }
            }
        if sim.rng.random() < self.config.line_fail:
            sim.counts["batch_lines_failed"] += 1
            return 500, {
                "error": {
                    "message": "The server had an error while processing your request.",
                    "type": "server_error",
                    "code": None,
                }
            }
        budget = int(
            body.get("max_completion_tokens")
            or body.get("max_tokens")
            or sim.config.default_max_tokens
        )
        prompt_tokens = count_prompt_tokens(messages, model)
        refusal = None
        schema = requested_schema(body)
        if schema is not None:  # typed outputs: JSON generated from the schema, as the chat route
            content, refusal, completion_tokens, finish = structured_answer(
                schema, messages, model, budget, config=sim.config
            )
        else:
            content, completion_tokens, finish = answer(
                messages, model, budget, max_answer_tokens=sim.config.max_answer_tokens
            )
        sim.counts["completion_tokens"] += completion_tokens
        return 200, {
            "id": f"chatcmpl-b{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, "refusal": refusal},
                    "finish_reason": finish,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
