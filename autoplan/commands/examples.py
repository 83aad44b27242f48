"""`python -m autoplan.commands.examples --regenerate-examples`: rewrite the committed examples.

generated/examples.json lists each example's `autoplan generate` arguments; a test regenerates
them and fails when the committed files drift from what the code now writes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from autoplan.commands.generate import command
from autoplan.errors import UserError
from autoplan.paths import repo_root


def examples_spec() -> list[dict[str, Any]]:
    """generated/examples.json: [{"dir": name, "args": [MODEL, plan options...]}]."""
    root = repo_root()
    if root is None:
        raise UserError("the committed examples live in a source checkout of autoplan; run this there")
    return json.loads((root / "generated" / "examples.json").read_text())


def regenerate_examples(target: Path) -> list[Path]:
    """Generate every example of generated/examples.json into target/<dir> (replacing it)."""
    dirs = []
    for example in examples_spec():
        out = target / example["dir"]
        if out.is_dir():
            shutil.rmtree(out)
        command.main(args=[*example["args"], "-o", str(out)], prog_name="autoplan generate",
                     standalone_mode=False)
        dirs.append(out)
    return dirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoplan.commands.examples")
    parser.add_argument("--regenerate-examples", action="store_true", required=True,
                        help="rewrite the committed examples under generated/ (see generated/examples.json)")
    parser.add_argument("--into", default=None, help="another root directory to write them to")
    args = parser.parse_args(argv)
    root = Path(args.into) if args.into else (repo_root() or Path.cwd()) / "generated"
    for path in regenerate_examples(root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
