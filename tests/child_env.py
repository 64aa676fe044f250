"""The PYTHONPATH for a test's child `python -m mlxcel_cli.main`: the repository first (its own package, not an
installed copy), then whatever the test process had (a machine whose dependencies live on PYTHONPATH, such as the
H200 image's /tmp/site, must keep them)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def repo_pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
