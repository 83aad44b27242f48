"""The only module that knows where autoplan's data lives.

In a source checkout (editable install) the data sits at the top of the repo:
``cost_models/`` and ``templates/``. In a wheel it is shipped inside the package as
``autoplan/_cost_models`` and ``autoplan/_templates``. ``AUTOPLAN_DATA_DIR`` overrides
the cost-model directory (a user's own catalogue of GPUs, prices and models).
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _first_existing(*candidates: Path) -> Path:
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"autoplan data directory not found; looked in: {', '.join(map(str, candidates))}"
    )


def cost_models_dir() -> Path:
    """Directory holding gpus/, clusters/, prices/ and models/ data files."""
    override = os.environ.get("AUTOPLAN_DATA_DIR")
    if override:
        return Path(override)
    return _first_existing(_PACKAGE_DIR.parent / "cost_models", _PACKAGE_DIR / "_cost_models")


def templates_dir() -> Path:
    """Directory holding the jinja2 templates of generated jobs."""
    return _first_existing(_PACKAGE_DIR.parent / "templates", _PACKAGE_DIR / "_templates")


def repo_root() -> Path | None:
    """The source checkout this package runs from, or None for an installed wheel."""
    root = _PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() else None
