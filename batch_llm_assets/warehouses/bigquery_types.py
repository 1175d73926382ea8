"""BigQuery's column types for the output's logical types: apart from bigquery_dml.py, so that
defining assets (their metadata names the types) does not import google-cloud-bigquery."""

_SCALAR_TYPES = {
    "string": "STRING",
    "int": "INT64",
    "float": "FLOAT64",
    "float32": "FLOAT64",  # BigQuery has no 32-bit float: a float32 is exact in FLOAT64
    "timestamp": "TIMESTAMP",
    "bool": "BOOL",
    # Typed outputs: an object field is JSON text in a STRING column (JSON_VALUE etc. read it);
    # bqemulator stores a JSON column as STRING, so a JSON type would not survive a round trip.
    "json": "STRING",
}
# Typed outputs: a list of scalars is a REPEATED column (ARRAY<...>); BigQuery has no NULL
# array, so an invalid answer's list is written as [].
TYPES = {
    **_SCALAR_TYPES,
    **{
        f"list<{k}>": f"ARRAY<{_SCALAR_TYPES[k]}>"
        for k in ("string", "int", "float", "float32", "bool")
    },
}
