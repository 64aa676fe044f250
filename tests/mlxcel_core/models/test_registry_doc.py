"""docs/models.md's family table lists exactly the model_types in the live registry, with their modules, and its
benchmark-shape table exactly the shapes `--model-shape` builds."""

from __future__ import annotations

import importlib
from pathlib import Path

from mlxcel_core.loading.shapes import SHAPES
from mlxcel_core.models import REGISTRY

DOC = Path(__file__).resolve().parents[3] / "docs" / "models.md"


def documented(section_name: str) -> dict[str, str]:
    """First cell -> second cell of the table under '## section_name' (rows whose first cell is `code`)."""
    rows: dict[str, str] = {}
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif section == section_name and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            key, value = cells[0].strip("`"), cells[1].strip("`")
            assert key not in rows, f"docs/models.md lists {key} twice under {section_name}"
            rows[key] = value
    return rows


def documented_families() -> dict[str, str]:
    return documented("Families")


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


def test_shape_table_lists_exactly_the_bench_shapes_with_their_model_types():
    rows = documented("Benchmark shapes")
    assert sorted(rows) == sorted(SHAPES), "docs/models.md's Benchmark shapes table differs from loading/shapes.py"
    for name, model_type in rows.items():
        assert SHAPES[name]["model_type"] == model_type, f"docs/models.md: shape {name} is a {model_type}"
        assert model_type in REGISTRY, f"shape {name}: model_type {model_type} is not registered"
