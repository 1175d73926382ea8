"""DuckDB's column types for the output's logical types, and rows as Arrow (or pandas) data."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .base import OutputTable

if TYPE_CHECKING:
    import pandas as pd

_NULLABLE = {"int": "Int64", "float": "Float64", "float32": "Float32", "bool": "boolean"}
_ARROW = {
    "string": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "float32": pa.float32(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "bool": pa.bool_(),
    "json": pa.string(),  # JSON text; DuckDB casts it to its JSON type
}
SCALAR_TYPES = {
    "string": "VARCHAR",
    "int": "BIGINT",
    "float": "DOUBLE",
    # An embedding's numbers: float32 is what the providers compute and send (base64 of
    # float32); stored as it came, at half the size of DOUBLE.
    "float32": "FLOAT",
    "timestamp": "TIMESTAMPTZ",
    "bool": "BOOLEAN",
    "json": "JSON",  # typed outputs: an object field, queryable with ->> and json_extract
}
# Typed outputs: a list of scalars is a DuckDB LIST (list<string> -> VARCHAR[]).
TYPES = {
    **SCALAR_TYPES,
    **{f"list<{k}>": f"{SCALAR_TYPES[k]}[]" for k in ("string", "int", "float", "float32", "bool")},
}
# An existing column of a wider type takes the values as they are (an embedding table made
# when vectors were stored as DOUBLE[] keeps working).
WIDER = {"FLOAT[]": ("DOUBLE[]",)}
# information_schema spells some types out.
SPELLED = {"TIMESTAMPTZ": "TIMESTAMP WITH TIME ZONE"}


def arrow_table(output: OutputTable, rows: list[dict[str, Any]]) -> pa.Table:
    """The rows as an Arrow table of the output's types. Python values are converted here, in
    one pass per column; DuckDB then scans Arrow without holding the GIL, where a pandas frame
    of Python objects makes it convert each value under the GIL, stalling the event loop that
    receives the answers (measured: 1.5 ms of GIL per 1,000 rows here against about 19)."""
    arrays = [pa.array([r["id"] for r in rows])]  # the id keeps its inferred type
    for col, kind in output.columns:
        arrays.append(pa.array([r.get(col) for r in rows], type=_arrow_type(kind)))
    return pa.Table.from_arrays(arrays, names=output.names)


def _arrow_type(kind: str) -> pa.DataType:
    if kind.startswith("list<"):
        return pa.list_(_arrow_type(kind[5:-1]))
    return _ARROW[kind]


def frame(output: OutputTable, rows: list[dict[str, Any]]) -> pd.DataFrame:
    # Imported here: every Dagster process loads the definitions, and only this fallback and a
    # rerun's lookup of done rows need pandas (about a third of the definitions' import time).
    import pandas as pd

    frame = pd.DataFrame(rows, columns=output.names)
    for col, kind in output.columns:  # nullable dtypes: a missing number is NULL, not NaN
        if kind in _NULLABLE:
            frame[col] = frame[col].astype(_NULLABLE[kind])
    return frame
