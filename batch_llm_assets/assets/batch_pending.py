"""Batch mode's pending rows: each row not done and not in an open batch, rendered into the
exact request live mode would send (the same identity, so either mode's answers count as done)
and into a line of the batch input file.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from ..engine import errors as E
from ..engine.batch_api import BatchLine
from ..engine.identity import request_identity
from ..engine.structured import provider_kind
from ..engine.tokens import count_prompt_tokens, requested_max_tokens
from ..resources.llm import LLMResource
from ..warehouses.base import SliceFilter, WarehouseSession
from .batch_results import BatchRows, custom_id
from .pipeline import RunSpec
from .sharing import follower_row, reuses_answers
from .template_breaker import TemplateBreaker


class PendingLines:
    """The batch lines of a partition's pending rows (`scan`), and what each line is for
    (`items`: custom_id -> (row id, request identity))."""

    def __init__(
        self,
        spec: RunSpec,
        llm: LLMResource,
        session: WarehouseSession,
        where: SliceFilter,
        *,
        partition_key: str,
        state_table: str,
        asset: str,
        rows: BatchRows,
    ) -> None:
        self.spec, self.db, self.where, self.rows = spec, session, where, rows
        self.partition_key, self.state_table, self.asset = partition_key, state_table, asset
        engine = llm.engine_settings(model=spec.model, params=spec.params)
        self.model, self.params = engine.model, engine.params
        self.max_tokens = requested_max_tokens(self.params, engine.default_max_tokens)
        self.window = engine.context_window
        self.max_prompt_chars = spec.prompt.max_chars_for(self.window)  # as live mode bounds it
        # Typed outputs: asked for in the provider's form, validated per line (no repair turn).
        self.provider_kind = provider_kind(
            llm.base_url, api_version=llm.api_version, provider=getattr(llm, "provider", None)
        )
        self.stats = rows.stats
        self.scopes = spec.identity_scopes(llm)
        self.finalized: set[Any] = set()  # ids this run wrote or found done: not sent again
        self.reuse = reuses_answers(spec.reuse_answers, self.params)
        self.items: dict[str, tuple[Any, str]] = {}  # custom_id -> (row id, identity), to send
        self.leaders: dict[str, str] = {}  # identity -> custom_id of the line sent for it
        self.followers: dict[str, list[tuple[str, Any, str]]] = {}  # leader's custom_id -> rows
        self.deferred = False  # rows wait for the answer of a batch of an earlier run

    def scan(self) -> list[BatchLine]:
        """Rows not ok with the same request, not in an open batch, not written by this run;
        of the rows of one identity, only the first is a line (`_distinct`)."""
        in_flight: set[str] = set()
        busy: set[str] = set()  # identities in an open batch
        for record in self.db.batch_states(
            self.state_table, self.asset, self.partition_key, open_only=True
        ):
            items = json.loads(record["items"])
            in_flight.update(items)
            busy.update(item[1] for item in items.values())
        lines: list[BatchLine] = []
        ready: list[dict[str, Any]] = []  # rows failed unsent or answered already
        self.items, self.leaders, self.followers, self.deferred = {}, {}, {}, False
        breaker = TemplateBreaker()
        nothing_done = not self.db.has_output(self.spec.output.name, self.partition_key)
        src = self.spec.source
        try:
            for chunk in self.db.read_slice(src, self.where, self.spec.chunk_rows):
                ids = [r[src.id_column] for r in chunk]
                done = (
                    {}
                    if nothing_done
                    else self.db.done_hashes(self.spec.output, self.partition_key, ids)
                )
                candidates = []
                for row in chunk:
                    line = self._line(row, done, in_flight, ready, breaker)
                    if line is not None:
                        candidates.append(line)
                lines += self._distinct(candidates, ready, busy, self.reuse or not nothing_done)
        finally:  # the rows that failed before the template breaker stopped the scan, too
            for i in range(0, len(ready), self.spec.chunk_rows):
                self.db.write_results(self.spec.output, ready[i : i + self.spec.chunk_rows])
        return lines

    def _distinct(
        self,
        candidates: list[BatchLine],
        ready: list[dict[str, Any]],
        busy: set[str],
        look_up: bool,
    ) -> list[BatchLine]:
        """The chunk's lines to send, as the live path sends requests (assets/sharing.py): an
        identity answered `ok` in the output table (this partition's rows, or any partition's
        when answers are reused) is not sent, its rows take that answer now; of the lines of one
        identity only the first (the leader) is sent, the others' rows take its answer when
        its batch is collected (`followers`, recorded with it). A row whose identity is in a
        batch of an earlier run waits for that batch (`deferred`): the next scan finds its
        answer."""
        hashes = [self.items[ln.custom_id][1] for ln in candidates]
        wanted = [h for h in dict.fromkeys(hashes) if h not in self.leaders and h not in busy]
        stored = (
            self.db.stored_answers(
                self.spec.output, wanted, self.partition_key, everywhere=self.reuse
            )
            if look_up and wanted
            else {}
        )
        now = datetime.now(UTC)
        lines = []
        for line, rhash in zip(candidates, hashes, strict=True):
            cid = line.custom_id
            leader = self.leaders.get(rhash)
            if leader is None and rhash not in busy and rhash not in stored:
                self.leaders[rhash] = cid
                lines.append(line)
                continue
            rid, _ = self.items.pop(cid)
            if leader is not None:
                self.followers.setdefault(leader, []).append((cid, rid, rhash))
            elif rhash in busy:
                self.deferred = True
            else:
                self.finalized.add(rid)
                source = stored[rhash]
                ready.append(self._shared(source, rid, now))
        return lines

    def _shared(self, source: dict[str, Any], rid: Any, now: datetime) -> dict[str, Any]:
        return follower_row(
            source, rid, partition_key=self.partition_key, now=now, stats=self.stats, reused=True
        )

    def record_items(self, lines: list[BatchLine]) -> dict[str, list[Any]]:
        """What a batch's state record holds: custom_id -> [row id, identity] of each line, and
        [row id, identity, the leader's custom_id] of each row that takes a line's answer."""
        items: dict[str, list[Any]] = {}
        for line in lines:
            items[line.custom_id] = list(self.items[line.custom_id])
            for cid, rid, rhash in self.followers.get(line.custom_id, ()):
                items[cid] = [rid, rhash, line.custom_id]
        return items

    def _line(
        self,
        row: dict[str, Any],
        done: dict[Any, str],
        in_flight: set[str],
        failed: list[dict[str, Any]],
        breaker: TemplateBreaker,
    ) -> BatchLine | None:
        """The row's batch line; None when it is done, in an open batch, or failed unsent
        (then its row is in `failed`)."""
        rendered = self._rendered(row, failed, breaker)
        if rendered is None:
            return None
        rid, messages = rendered
        shaped: dict[str, Any] = {}
        key = {**self.params, "model": self.model, "messages": messages}  # identity: reader.py
        if (schema := self.spec.output_schema) is not None:
            shaped, messages = schema.shape(self.provider_kind, messages)
            key |= schema.identity
        body = {**self.params, **shaped, "model": self.model, "messages": messages}
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = key["max_tokens"] = self.max_tokens
        rhash = request_identity(key, self.scopes[0])
        cid = custom_id(rid, rhash)
        stored = done.get(rid)
        # Rows stored, or in a batch, under the earlier identities are recognised too.
        legacy = request_identity(key, self.scopes[1]) if stored or in_flight else None
        exact = request_identity(body, self.scopes[0]) if (stored or in_flight) and schema else None
        if stored is not None and stored in (rhash, legacy, exact):
            self.stats.skipped += 1
            self.finalized.add(rid)
            return None
        if cid in in_flight or any(h and custom_id(rid, h) in in_flight for h in (legacy, exact)):
            return None
        tokens = count_prompt_tokens(messages, self.model) + self.max_tokens
        if self.window and tokens > self.window:
            self.finalized.add(rid)
            failed.append(self._too_long(rid, rhash, tokens))
            return None
        self.items[cid] = (rid, rhash)
        return BatchLine(cid, body, tokens)

    def _rendered(
        self, row: dict[str, Any], failed: list[dict[str, Any]], breaker: TemplateBreaker
    ) -> tuple[Any, list[dict[str, str]]] | None:
        """(row id, rendered messages); None for a row this run finished or that fails to
        render (its row then in `failed`)."""
        src = self.spec.source
        rid = row[src.id_column]
        if rid in self.finalized:
            return None
        if not isinstance(rid, int | str):
            raise E.BatchLLMError(
                description=f"Batch mode needs integer or string ids; {src.id_column!r} "
                f"of {src.table!r} holds {type(rid).__name__} values. Use live mode or "
                "an integer or string id column."
            )
        messages, problem = self.spec.prompt.render(row, max_chars=self.max_prompt_chars)
        if problem is not None:
            self.finalized.add(rid)
            failed.append(self.rows.failed(rid, None, problem[0], f"{problem[1]}; not sent"))
            if breaker.observe(*problem) and breaker.error is not None:
                raise breaker.error  # the rows failed so far are written on the way out
            return None
        breaker.observe(None, None)
        return rid, messages

    def _too_long(self, rid: Any, rhash: str, tokens: int) -> dict[str, Any]:
        message = (
            f"prompt + max_tokens is about {tokens} tokens, over the model's context window of "
            f"{self.window}; not sent"
        )
        return self.rows.failed(rid, rhash, E.CONTEXT_LENGTH, message)
