"""The demo's dataset: deterministic synthetic financial headlines, 300 a day for 10 days."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import duckdb

DEMO_START = "2026-11-01"
DEMO_DAYS = 10
ROWS_PER_DAY = 300

_COMPANIES = [
    "Acme Corp",
    "Globex",
    "Initech",
    "Umbrella",
    "Stark Industries",
    "Wayne Enterprises",
    "Hooli",
    "Soylent",
    "Tyrell",
    "Cyberdyne",
    "Wonka",
    "Vandelay Imports",
]
_EVENTS = [
    "beats earnings estimates",
    "misses revenue forecast",
    "raises full-year guidance",
    "cuts 5% of workforce",
    "announces share buyback",
    "faces antitrust probe",
    "shares slide after downgrade",
    "wins major government contract",
    "reports record quarterly profit",
    "delays product launch",
    "names new CEO",
    "shares flat ahead of results",
]
_CONTEXT = [
    "as markets rally",
    "amid rate worries",
    "despite weak demand",
    "in volatile trading",
    "after analyst day",
    "as oil prices climb",
    "",
    "",
]


def headlines(days: int = DEMO_DAYS, per_day: int = ROWS_PER_DAY, seed: int = 2026):
    """(id, published_at, headline) rows, the same on every machine."""
    rng = random.Random(seed)
    start = datetime.fromisoformat(DEMO_START).replace(tzinfo=UTC)
    for day in range(days):
        for i in range(per_day):
            published = start + timedelta(days=day, seconds=rng.randrange(86_400))
            text = f"{rng.choice(_COMPANIES)} {rng.choice(_EVENTS)} {rng.choice(_CONTEXT)}".strip()
            yield day * per_day + i + 1, published, text


def create_demo_table(path: str, table: str = "news_headlines", **kw) -> int:
    """(Re)create the source table in a DuckDB file; returns its row count."""
    rows = list(headlines(**kw))
    con = duckdb.connect(path)
    try:
        con.execute(
            f'CREATE OR REPLACE TABLE "{table}" '
            "(id BIGINT, published_at TIMESTAMPTZ, headline VARCHAR)"
        )
        con.executemany(f'INSERT INTO "{table}" VALUES (?, ?, ?)', rows)
        return con.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
    finally:
        con.close()
