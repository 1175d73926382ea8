"""`--redis.request-queues`: the request queues one worker serves, each with its own gateway,
inference objective, limiter job and dead-letter list.

The entries are llm-d's queues-config entries (`queue_name`, `id`, `igw_base_url`,
`inference_objective`, `request_path_url`), plus ours: `type` (sortedset or list), `job_key`,
`weight` (the merge policy's and the limiter job's) and `dead_letter`. The text is JSON or YAML:
a list of entries.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import yaml

from ..engine import _constants as C
from . import _constants as K
from .queue import QueueNames

MERGE_POLICIES = ("random-robin", "weighted", "deadline-first")
KINDS = ("sortedset", "list")
_FIELDS = {
    "queue_name",
    "id",
    "type",
    "igw_base_url",
    "base_url",
    "inference_objective",
    "request_path_url",
    "job_key",
    "weight",
    "dead_letter",
}
# llm-d fields this worker has no counterpart for: refused by name, so that a config pasted
# from llm-d does not silently lose a setting.
_LLM_D_ONLY = {
    "worker_pool_id": "worker pools: one worker serves every queue (--concurrency)",
    "labels": "routing labels: no dispatch gates read them here",
    "gate_type": "dispatch gates: the shared limiter paces sends (--rpm/--tpm)",
    "gate_params": "dispatch gates: the shared limiter paces sends (--rpm/--tpm)",
    "result_queue_name": "one result list for every queue (--redis.ss.result-queue-name)",
}


class QueueConfigError(ValueError):
    """A request-queues config that cannot be served; the message names the problem."""


@dataclass(frozen=True, slots=True)
class RequestQueue:
    """One request queue. None: the worker's own setting (base URL, job key)."""

    name: str
    kind: str = "sortedset"
    id: str | None = None  # queue_id label of its metrics; default: the name
    base_url: str | None = None
    inference_objective: str = ""
    job_key: str | None = None
    weight: float = 1.0
    dead_letter: str | None = None  # default: "<name>:dead-letter"

    @property
    def queue_id(self) -> str:
        return self.id or self.name

    def names(self, shared: QueueNames) -> QueueNames:
        """Its Redis keys: its own request, processing and retry sets and dead-letter list; the
        result list (and its per-id keys) shared, so an id has one result across queues."""
        listed = self.kind == "list"
        return QueueNames(
            request_sortedset=f"{self.name}:sortedset" if listed else self.name,
            request_list=self.name if listed else None,
            retry_sortedset=f"{shared.retry_sortedset}:{self.name}",
            result_list=shared.result_list,
            result_stream=shared.result_stream,
            processing=f"{self.name}:processing",
            dead_letter=self.dead_letter or f"{self.name}:dead-letter",
        )

    def validate(self) -> None:
        where = f"request queue {self.name!r}"
        for field in ("name", "id", "dead_letter"):
            _check_key_text(getattr(self, field), f"{where}: {field}", optional=field != "name")
        if self.job_key is not None:
            check_job_key(self.job_key, f"{where}: job_key")
        if self.kind not in KINDS:
            raise QueueConfigError(f"{where}: type must be one of {KINDS}, got {self.kind!r}")
        if self.base_url is not None:
            check_base_url(self.base_url, f"{where}: igw_base_url")
        _check_header_value(self.inference_objective, f"{where}: inference_objective")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < math.inf:
            raise QueueConfigError(f"{where}: weight must be a finite number > 0, got {w!r}")


def check_base_url(url: Any, what: str) -> None:
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise QueueConfigError(f"{what} must be an http:// or https:// URL, got {url!r}")


def _check_key_text(value: Any, what: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise QueueConfigError(f"{what} must be a non-empty string, got {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise QueueConfigError(f"{what} is not valid text (a lone surrogate)") from None
    if len(value) > K.MAX_CONFIG_TEXT:
        raise QueueConfigError(f"{what} is longer than {K.MAX_CONFIG_TEXT} characters")


def check_job_key(value: Any, what: str) -> None:
    """The engine's one rule for a job_key (it names the limiter's Redis keys), as LLMResource
    holds it: 1 to MAX_JOB_KEY_CHARS characters, none of them a control character."""
    _check_key_text(value, what, optional=False)
    if len(value) > C.MAX_JOB_KEY_CHARS or not re.fullmatch(C.JOB_KEY_PATTERN, value):
        raise QueueConfigError(
            f"{what} must be 1-{C.MAX_JOB_KEY_CHARS} printable characters (no control "
            f"character), got {value[:60]!r}{'...' if len(value) > 60 else ''}"
        )


def _check_header_value(value: Any, what: str) -> None:
    """An HTTP header value: printable ASCII, so that it cannot split the request."""
    if not isinstance(value, str):
        raise QueueConfigError(f"{what} must be a string, got {value!r}")
    if len(value) > K.MAX_CONFIG_TEXT or any(not " " <= c <= "~" for c in value):
        raise QueueConfigError(
            f"{what} must be printable ASCII of at most {K.MAX_CONFIG_TEXT} characters "
            "(it is sent as the x-gateway-inference-objective header)"
        )


def validate_queues(queues: tuple[RequestQueue, ...], shared: QueueNames) -> None:
    """Each entry, then what they must not share: a name, an id, or any request, processing
    or retry key (two queues on one key would take each other's messages)."""
    if not queues:
        raise QueueConfigError("request queues: the list is empty")
    if len(queues) > K.MAX_REQUEST_QUEUES:
        raise QueueConfigError(f"request queues: more than {K.MAX_REQUEST_QUEUES} queues")
    owner = {shared.result_list: "the result list"}
    ids: set[str] = set()
    for q in queues:
        if not isinstance(q, RequestQueue):
            raise QueueConfigError(f"request queues: {q!r} is not a RequestQueue")
        q.validate()
        n = q.names(shared)
        for key in (n.request_sortedset, n.request_list, n.processing_set, n.retry_sortedset):
            if key is None:
                continue
            if key in owner and owner[key] == f"queue {key!r}":
                raise QueueConfigError(f"request queues: duplicate queue_name {key!r}")
            if key in owner:
                raise QueueConfigError(
                    f"request queues: key {key!r} of queue {q.name!r} is also used by {owner[key]}"
                )
            owner[key] = f"queue {q.name!r}"
        if q.queue_id in ids:
            raise QueueConfigError(f"request queues: duplicate queue id {q.queue_id!r}")
        ids.add(q.queue_id)


def parse_request_queues(text: str) -> tuple[RequestQueue, ...]:
    """The queues of a JSON or YAML list of entries; QueueConfigError names what is wrong."""
    try:
        try:
            data = json.loads(text)
        except ValueError:
            data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise QueueConfigError(f"request queues: neither JSON nor YAML: {exc}") from None
    except RecursionError:
        raise QueueConfigError("request queues: nested too deep") from None
    if not isinstance(data, list):
        raise QueueConfigError("request queues: expected a list of queue entries")
    if not data:
        raise QueueConfigError("request queues: the list is empty")
    return tuple(_entry(e, i) for i, e in enumerate(data))


def _entry(entry: Any, i: int) -> RequestQueue:
    if not isinstance(entry, dict):
        raise QueueConfigError(f"request queues[{i}]: expected an object, got {entry!r}")
    for key in entry:
        if key in _LLM_D_ONLY:
            raise QueueConfigError(
                f"request queues[{i}]: {key} is not supported ({_LLM_D_ONLY[key]})"
            )
        if key not in _FIELDS:
            raise QueueConfigError(f"request queues[{i}]: unknown field {key!r}")
    if "base_url" in entry and "igw_base_url" in entry:
        raise QueueConfigError(f"request queues[{i}]: give igw_base_url or base_url, not both")
    path = entry.get("request_path_url")
    if path is not None and not (isinstance(path, str) and path.endswith("chat/completions")):
        raise QueueConfigError(
            f"request queues[{i}]: request_path_url {path!r} is not supported: this worker "
            "sends chat completions"
        )
    return RequestQueue(
        name=entry.get("queue_name"),  # type: ignore[arg-type]  (validated later, by name)
        kind=entry.get("type", "sortedset"),
        id=entry.get("id"),
        base_url=entry.get("igw_base_url", entry.get("base_url")),
        inference_objective=entry.get("inference_objective") or "",
        job_key=entry.get("job_key"),
        weight=entry.get("weight", 1.0),
        dead_letter=entry.get("dead_letter"),
    )
