"""docs/models.md's family table lists exactly the model_types in the live registry, with their modules."""

from __future__ import annotations

import importlib
from pathlib import Path

from mlxcel_core.models import REGISTRY

DOC = Path(__file__).resolve().parents[3] / "docs" / "models.md"


def documented_families() -> dict[str, str]:
    """model_type -> module from the table under '## Families' (rows whose first cell is `code`)."""
    rows: dict[str, str] = {}
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif section == "Families" and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            model_type, module = cells[0].strip("`"), cells[1].strip("`")
            assert model_type not in rows, f"docs/models.md lists {model_type} twice"
            rows[model_type] = module
    return rows


def test_table_lists_exactly_the_registered_model_types():
    documented = documented_families()
    missing = sorted(REGISTRY.keys() - documented.keys())
    extra = sorted(documented.keys() - REGISTRY.keys())
    assert not missing, f"model_types registered but missing from docs/models.md: {', '.join(missing)}"
    assert not extra, f"docs/models.md lists model_types the registry lacks: {', '.join(extra)}"


def test_table_names_each_family_module():
    for model_type, module in documented_families().items():
        if model_type in REGISTRY:  # extra rows are the previous test's failure
            assert module == REGISTRY[model_type], f"docs/models.md: {model_type} is in {REGISTRY[model_type]}.py"


def test_every_registered_module_imports_and_defines_a_model():
    for module in sorted(set(REGISTRY.values())):
        mod = importlib.import_module(f"mlxcel_core.models.{module}")
        assert hasattr(mod, "Model") and hasattr(mod, "ModelArgs"), module
