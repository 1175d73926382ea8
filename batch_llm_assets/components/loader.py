"""Load a folder of component YAML (defs.yaml files) into Definitions."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from types import ModuleType

import dagster as dg


def _project_root(folder: Path) -> Path:
    for parent in (folder, *folder.parents):
        if (parent / "pyproject.toml").is_file() or (parent / "setup.py").is_file():
            return parent
    return folder


def load_defs_folder(defs_module: str | ModuleType) -> dg.Definitions:
    """Every component declared under the package `defs_module` (e.g. "batch_llm_assets.defs":
    one folder per component, each with a defs.yaml), merged into one Definitions.

    The same component tree `dg.load_from_defs_folder` builds (`dg.ComponentTree` over the
    folder), usable outside a dg project (tests, other code locations), and built at the folder
    rather than the project root: that skips the catalogue of every installed component type
    (UI metadata whose discovery imports each registered library, ~2 s per process).
    The folder needs no __init__.py.

    Invalid attributes raise at load; the component's own error (e.g. LlmBatchConfigError,
    "prompt.template: unknown column 'body'") is the cause of Dagster's ComponentTreeException.
    """
    module = importlib.import_module(defs_module) if isinstance(defs_module, str) else defs_module
    folder = Path(next(iter(module.__path__)))  # a package, with or without __init__.py
    tree = dg.ComponentTree.from_module(defs_module=module, project_root=_project_root(folder))
    with warnings.catch_warnings():  # code references on YAML-declared assets are beta
        warnings.simplefilter("ignore", dg.BetaWarning)
        warnings.simplefilter("ignore", dg.PreviewWarning)
        defs = tree.build_defs(folder)
    return dg.Definitions.merge(defs, dg.Definitions(component_tree=tree))
