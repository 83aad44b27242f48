"""The wheel a job's nodes install: autoplan's training half, built from this installation.

Cloud launch files (sky.yaml, pytorchjob.yaml) must not `pip install autoplan` by name: on the
public index that name belongs to another project. `generate` writes this wheel into the job
directory instead, and the launch files install it by path with `--no-deps` (the runtime needs
torch and the standard library only).

It holds what a generated train.py imports and nothing of the planner: the contract modules
(`errors`, `limits`, `plan`, `config`, `paths`), the model families (`models`), the runtime and
the catalog's model configs (train.py of a catalog model reads its config there). The bytes
depend only on those files: entries are sorted and dated 1980-01-01 (the earliest date a zip
holds), so the same sources give the same wheel (the committed examples stay comparable).

Format: PEP 427 (binary distribution) with PEP 376 RECORD hashes (urlsafe base64 sha256,
no padding), a flat `.dist-info` folder beside the package.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from io import BytesIO
from pathlib import Path

from autoplan import __version__
from autoplan.paths import cost_models_dir

DISTRIBUTION = "autoplan_runtime"
_PACKAGE = Path(__file__).resolve().parents[1]
# what a generated train.py imports: the runtime, the model families and the contract it reads
# (tests/codegen/test_job_imports.py holds every committed example to this list)
JOB_MODULES = ("__init__", "errors", "limits", "plan", "plan_schema", "config", "paths", "files", "textfile")
JOB_PACKAGES = ("models", "runtime")
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def wheel_name() -> str:
    return f"{DISTRIBUTION}-{__version__}-py3-none-any.whl"


def _sources() -> dict[str, bytes]:
    """Archive path -> bytes of every file the wheel ships."""
    files = {f"autoplan/{name}.py": (_PACKAGE / f"{name}.py").read_bytes() for name in JOB_MODULES}
    for package in JOB_PACKAGES:
        for path in sorted((_PACKAGE / package).rglob("*.py")):
            files[f"autoplan/{path.relative_to(_PACKAGE).as_posix()}"] = path.read_bytes()
    for path in sorted((cost_models_dir() / "models").glob("*.json")):
        files[f"autoplan/_cost_models/models/{path.name}"] = path.read_bytes()
    return files


def _metadata() -> dict[str, bytes]:
    info = f"{DISTRIBUTION}-{__version__}.dist-info"
    return {
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {DISTRIBUTION.replace('_', '-')}\n"
                             f"Version: {__version__}\nSummary: autoplan's training runtime, "
                             "written by `autoplan generate` for a job's nodes\n"
                             "Requires-Python: >=3.11\nRequires-Dist: torch>=2.6\n").encode(),
        f"{info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: autoplan generate\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def runtime_wheel() -> bytes:
    """The wheel's bytes (deterministic for the same sources)."""
    files = {**_sources(), **_metadata()}
    record = f"{DISTRIBUTION}-{__version__}.dist-info/RECORD"
    lines = [_record_line(name, data) for name, data in sorted(files.items())] + [f"{record},,"]
    files[record] = ("\n".join(lines) + "\n").encode()
    buffer = BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(files):
            entry = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = 0o644 << 16
            archive.writestr(entry, files[name])
    return buffer.getvalue()
