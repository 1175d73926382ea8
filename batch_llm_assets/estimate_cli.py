"""`batch-llm-assets estimate`: what a partition, a range or every missing partition of a batch
asset will cost, printed as a table and, last, one JSON line. Nothing is sent to the provider.

    batch-llm-assets estimate headline_sentiment --partition 2026-11-02
    batch-llm-assets estimate headline_sentiment --from 2026-11-01 --to 2026-11-10
    batch-llm-assets estimate -m my_project.definitions my_asset --missing

The definitions are a module's `dg.Definitions` (default: this package's demo code location); the
asset's LLM and warehouse resources are taken from them. --missing asks the Dagster instance of
DAGSTER_HOME which partitions have no materialization. A bad argument (unknown asset or
partition, inverted range, ...) exits 2 with one line saying what; a failure to read exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

import dagster as dg

from .assets.estimate import (
    EstimateInputError,
    batch_spec,
    estimate_cost,
    select_partitions,
    shown,
)
from .engine.errors import BatchLLMError

DEFAULT_MODULE = "batch_llm_assets.definitions"
INPUT_ERROR = 2
READ_ERROR = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("asset", help="asset key, e.g. headline_sentiment or prefix/name")
    p.add_argument(
        "-m",
        "--module-name",
        default=DEFAULT_MODULE,
        help=f"module holding the Definitions (default {DEFAULT_MODULE}, the demo)",
    )
    p.add_argument("-a", "--attribute", help="the Definitions' name in the module (default: defs)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--partition", help="one partition key")
    which.add_argument("--from", dest="start", help="first partition of a range (with --to)")
    which.add_argument(
        "--missing",
        action="store_true",
        help="every partition without a materialization in DAGSTER_HOME's instance",
    )
    p.add_argument("--to", dest="end", help="last partition of a range (included)")


def run(args: argparse.Namespace) -> int:
    """Print the estimate; the exit code says what went wrong, if anything."""
    try:
        asset, resources = _load(args.module_name, args.attribute, args.asset)
        spec = batch_spec(asset)
        with _instance(args.missing) as instance:
            keys = select_partitions(
                asset,
                partition=args.partition,
                start=args.start,
                end=args.end,
                missing=args.missing,
                instance=instance,
            )
        with dg.build_resources(_needed(resources, spec)) as built:
            llm = getattr(built, spec.llm_resource_key)
            warehouse = getattr(built, spec.warehouse_resource_key)
            est = estimate_cost(asset, llm=llm, warehouse=warehouse, partitions=keys)
    except EstimateInputError as exc:
        print(f"error: {exc.description}", file=sys.stderr)
        return INPUT_ERROR
    except BatchLLMError as exc:
        print(f"error: {exc.description}", file=sys.stderr)
        return READ_ERROR
    print(est.table())
    print(est.json_line(), flush=True)
    return 0


def _load(module: str, attribute: str | None, key: str) -> tuple[dg.AssetsDefinition, dict]:
    """The asset and the resources of the Definitions in `module`."""
    try:
        loaded = importlib.import_module(module)
    except Exception as exc:  # the user's module: any error in it is theirs to read
        raise EstimateInputError(
            description=f"Could not import module {shown(module)}: {type(exc).__name__}: "
            f"{str(exc)[:300]}"
        ) from None
    defs = getattr(loaded, attribute or "defs", None)
    if not isinstance(defs, dg.Definitions):
        raise EstimateInputError(
            description=f"Module {module!r} has no dg.Definitions named {attribute or 'defs'!r}."
        )
    try:
        asset_key = dg.AssetKey.from_user_string(key)
        asset = defs.resolve_assets_def(asset_key)
    except Exception:  # Dagster's error for an unknown or malformed key
        known = sorted(k.to_user_string() for k in defs.resolve_all_asset_keys())
        raise EstimateInputError(
            description=f"No asset {shown(key)} in {module}; its assets: "
            f"{', '.join(known[:10]) or 'none'}."
        ) from None
    return asset, dict(defs.resources or {})


def _needed(resources: dict[str, Any], spec: Any) -> dict[str, Any]:
    keys = (spec.llm_resource_key, spec.warehouse_resource_key)
    absent = [k for k in keys if k not in resources]
    if absent:
        raise EstimateInputError(
            description=f"The definitions bind no resource {' or '.join(map(repr, absent))}, "
            f"which asset {spec.name!r} uses."
        )
    return {k: resources[k] for k in keys}


def _instance(missing: bool) -> Any:
    """DAGSTER_HOME's instance when --missing needs one (none set: an empty one, and a note)."""
    if missing and os.environ.get("DAGSTER_HOME"):
        return dg.DagsterInstance.get()
    if missing:
        print("note: DAGSTER_HOME is not set: every partition counts as missing", file=sys.stderr)
    return dg.DagsterInstance.ephemeral()
