"""The packages import one another in the pipeline's direction only (docs/architecture.md).

Read from the source with `ast`, imports inside functions included: an import hidden in a
function body is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autoplan"

# What each top-level part of autoplan may import (besides itself). Lower layers first.
_BASE = {"errors", "paths", "limits", "files", "textfile"}
_CONTRACT = _BASE | {"plan", "plan_schema", "config"}
_TORCH_ONLY = _CONTRACT | {"models"}
_PLANNER = _TORCH_ONLY | {"hardware", "trace", "cost"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "paths": set(),
    "files": {"errors"},
    "textfile": {"errors"},
    "limits": {"errors"},
    "plan": {"errors", "limits", "config", "plan_schema"},
    "plan_schema": {"errors", "limits", "config"},
    "config": set(),
    "models": _CONTRACT,
    "runtime": _TORCH_ONLY,
    "hardware": _BASE,
    "trace": _TORCH_ONLY | {"runtime"},  # the capability probe applies the runtime itself
    "cost": _TORCH_ONLY | {"hardware", "trace"},
    "dryrun": _TORCH_ONLY | {"runtime", "trace"},  # runs the runtime on trace's fake group
    "solve": _PLANNER,
    "planfile": _PLANNER | {"solve"},
    "codegen": _PLANNER | {"solve", "__init__"},  # the runtime wheel is named with the version
    "validate": _PLANNER | {"solve"},
    "importers": _PLANNER | {"solve"},
    "calibrate": _PLANNER | {"runtime", "validate"},
    "report": _PLANNER | {"solve", "planfile", "validate", "codegen"},
    "tune": _PLANNER | {"solve", "codegen", "validate"},
    "commands": _PLANNER | {"solve", "planfile", "codegen", "validate", "importers", "calibrate", "report",
                            "dryrun", "tune"},
    "cli": _BASE | {"commands", "__init__"},
    "__main__": {"cli"},
    "__init__": set(),
}


def _is_part(name: str) -> bool:
    return (PACKAGE / f"{name}.py").is_file() or (PACKAGE / name).is_dir()


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imported_parts(path: Path) -> set[tuple[str, int]]:
    """(top-level autoplan part, line) of every autoplan import in the file, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "autoplan" else \
                [f"autoplan.{alias.name}" if _is_part(alias.name) else "autoplan.__init__"
                 for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "autoplan" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_cost_models" not in p.parts)


def test_every_part_has_a_rule():
    parts = {_part(p) for p in _sources()}
    assert parts <= set(ALLOWED), f"add {sorted(parts - set(ALLOWED))} to ALLOWED with its layer"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_pipeline(path):
    part = _part(path)
    wrong = sorted(f"line {line}: autoplan.{target}" for target, line in _imported_parts(path)
                   if target != part and target not in ALLOWED.get(part, set()))
    assert not wrong, f"autoplan/{path.relative_to(PACKAGE)} ({part}) imports {wrong}"


def test_the_rule_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from autoplan.solve.api import plan\n")
    assert ("solve", 2) in _imported_parts(bad)
