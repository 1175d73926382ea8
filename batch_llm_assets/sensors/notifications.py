"""Run-status notifications: a Slack-compatible message when a batch run ends, with its figures."""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.error
import urllib.request
from typing import Any

import dagster as dg

from ..engine.errors import redact

log = logging.getLogger(__name__)

# Figure of the message -> metadata key (assets/metadata.py): the partition's rows, this run's cost.
_FIGURES = {
    "rows_ok": "partition/rows_ok",
    "rows_failed": "partition/rows_failed",
    "rows_skipped": "run/rows_skipped",
    "cost_usd": "run/cost_usd",
    "wall_s": "run/wall_s",
}


def _figures(instance: dg.DagsterInstance, run_id: str) -> list[dict[str, Any]]:
    """Per asset partition of the run: the numbers from its materialisation or failure metadata."""
    out: list[dict[str, Any]] = []
    records = instance.get_records_for_run(
        run_id,
        of_type={dg.DagsterEventType.ASSET_MATERIALIZATION, dg.DagsterEventType.STEP_FAILURE},
    ).records
    for record in records:
        event = record.event_log_entry.dagster_event
        if event is None:
            continue
        if event.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION:
            mat = event.step_materialization_data.materialization
            md, asset, partition = mat.metadata, mat.asset_key.to_user_string(), mat.partition
        else:
            failure = event.step_failure_data
            user = failure.user_failure_data if failure else None
            md = dict(user.metadata) if user and user.metadata else {}
            asset, partition = event.step_key or "?", None
        out.append(
            {"asset": asset, "partition": partition}
            | {k: md[m].value for k, m in _FIGURES.items() if m in md}
        )
    return out


def _plans(instance: dg.DagsterInstance, run_id: str, keys: frozenset[dg.AssetKey]) -> bool:
    """Whether the run set out to materialise any of `keys`."""
    records = instance.get_records_for_run(
        run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED
    ).records
    for record in records:
        event = record.event_log_entry.dagster_event
        if event is not None and event.asset_key in keys:
            return True
    return False


def format_message(
    *,
    status: str,
    job: str,
    run_id: str,
    figures: list[dict[str, Any]],
    run_url: str | None,
    error: str | None = None,
) -> dict[str, Any]:
    """Slack's incoming-webhook JSON: a `text` fallback plus blocks."""
    icon = ":white_check_mark:" if status == "SUCCESS" else ":x:"
    lines = [f"{icon} *{job}* {status.lower()} (run `{run_id[:8]}`)"]
    for f in figures:
        part = f" [{f['partition']}]" if f.get("partition") else ""
        cost = f.get("cost_usd")
        cost_text = f"${cost:.4f}" if isinstance(cost, int | float) else str(cost or "not priced")
        lines.append(
            f"• {f['asset']}{part}: {f.get('rows_ok', '?')} ok, {f.get('rows_failed', '?')} "
            f"failed, {f.get('rows_skipped', 0)} skipped, cost {cost_text}, "
            f"wall {f.get('wall_s', '?')} s"
        )
    if error:
        lines.append(f"> {error[:500]}")
    if run_url:
        lines.append(f"<{run_url}|Open the run in Dagster>")
    text = "\n".join(lines)
    return {"text": text, "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]}


def post_json(
    url: str, payload: dict[str, Any], *, attempts: int = 3, timeout_s: float = 10.0
) -> None:
    """POST with retries on 5xx, 429 and connection errors. The URL (a secret) is never logged."""
    data = json.dumps(payload).encode()
    for attempt in range(1, attempts + 1):
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s):
                return
        except urllib.error.HTTPError as exc:
            if (exc.code < 500 and exc.code != 429) or attempt == attempts:
                raise RuntimeError(f"webhook answered HTTP {exc.code}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            if attempt == attempts:
                reason = redact(str(getattr(exc, "reason", exc)), url)
                raise RuntimeError(f"webhook unreachable: {reason}") from None
        time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)) * (0.75 + random.random() / 4))


def build_run_notification_sensors(
    *,
    webhook_url: str,
    monitored_jobs: list[Any] | None = None,
    asset_keys: list[dg.AssetKey] | None = None,
    dagster_url: str | None = None,
    name_prefix: str = "batch_llm_notify",
    attempts: int = 3,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> list[dg.SensorDefinition]:
    """Two run-status sensors (success, failure) posting each run's end to `webhook_url`.

    Pass the URL from the environment (it holds a token): `os.environ["SLACK_WEBHOOK_URL"]`.
    The message carries figures only, never resource configuration or keys. With `asset_keys`,
    only runs that materialise one of them are announced (however they were launched: a job,
    a backfill, the UI), so components watching every job do not each announce every run.
    """
    if not webhook_url.startswith(("https://", "http://")):
        raise ValueError("webhook_url must be an http(s) URL")
    watched = frozenset(asset_keys or ())

    def notify(context: dg.RunStatusSensorContext, status: str, error: str | None) -> None:
        run = context.dagster_run
        if watched and not _plans(context.instance, run.run_id, watched):
            return
        run_url = f"{dagster_url.rstrip('/')}/runs/{run.run_id}" if dagster_url else None
        payload = format_message(
            status=status,
            job=run.job_name,
            run_id=run.run_id,
            run_url=run_url,
            error=error,
            figures=_figures(context.instance, run.run_id),
        )
        post_json(webhook_url, payload, attempts=attempts)

    @dg.run_status_sensor(
        run_status=dg.DagsterRunStatus.SUCCESS,
        name=f"{name_prefix}_success",
        monitored_jobs=monitored_jobs,
        default_status=default_status,
    )
    def on_success(context: dg.RunStatusSensorContext):
        notify(context, "SUCCESS", None)

    @dg.run_failure_sensor(
        name=f"{name_prefix}_failure",
        monitored_jobs=monitored_jobs,
        default_status=default_status,
    )
    def on_failure(context: dg.RunFailureSensorContext):
        notify(context, "FAILURE", context.failure_event.message)

    return [on_success, on_failure]
