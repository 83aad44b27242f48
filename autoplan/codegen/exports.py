"""The plan in the configuration formats of other training stacks, one registry for all of them.

`autoplan generate` writes each file beside the job, `autoplan plan --format NAME` prints one,
and both list (in the file's header and on the terminal) what the stack cannot express.
"""

from __future__ import annotations

import json
import re
from typing import Callable, NamedTuple

from autoplan.codegen import torchtitan
from autoplan.codegen.deepspeed import ds_config, ds_config_notes
from autoplan.codegen.megatron import megatron_args, megatron_notes
from autoplan.errors import UserError
from autoplan.plan import Plan


class Export(NamedTuple):
    file_name: str
    stack: str
    render: Callable[[Plan, str], str]
    notes: Callable[[Plan, str], list[str]]
    version: str  # the release written for when none is asked for
    known_versions: tuple[str, ...]  # major.minor releases whose names the export knows


def _ds_json(plan: Plan) -> str:
    return json.dumps(ds_config(plan), indent=2) + "\n"


def _any_release(function: Callable[[Plan], object]) -> Callable[[Plan, str], object]:
    """An export function whose output is the same for every release of its stack."""
    return lambda plan, _version: function(plan)


EXPORTS = {
    "torchtitan": Export("torchtitan.toml", "torchtitan", torchtitan.torchtitan_toml, torchtitan.torchtitan_notes,
                         torchtitan.CURRENT_VERSION, torchtitan.KNOWN_VERSIONS),
    "megatron": Export("megatron.args", "Megatron-LM", _any_release(megatron_args), _any_release(megatron_notes),
                       "core_v0.16.1", ()),
    "deepspeed": Export("ds_config.json", "DeepSpeed", _any_release(_ds_json), _any_release(ds_config_notes),
                        "0.19", ()),
}


def parse_stack_versions(options: tuple[str, ...]) -> dict[str, str]:
    """`--stack-version STACK=VERSION` options as {stack: version}, each checked."""
    versions = {}
    for option in options:
        stack, _, version = option.partition("=")
        export = EXPORTS.get(stack.strip().lower())
        if export is None or not version:
            raise UserError(f"--stack-version {option!r}: give STACK=VERSION with STACK one of "
                            f"{', '.join(EXPORTS)} (for example torchtitan=0.2.2)")
        if not export.known_versions:
            raise UserError(f"--stack-version {option!r}: the {export.stack} file has no release-specific "
                            "names; leave it out")
        if not re.fullmatch(r"\d+\.\d+(\.\d+)?", version) or \
                ".".join(version.split(".")[:2]) not in export.known_versions:
            raise UserError(f"--stack-version {option!r}: autoplan writes {export.stack} releases "
                            f"{', '.join(export.known_versions)} (X.Y or X.Y.Z); give one of them")
        versions[stack.strip().lower()] = version
    return versions


def _version(name: str, versions: dict[str, str] | None) -> str:
    return (versions or {}).get(name, EXPORTS[name].version)


def export_files(plan: Plan, versions: dict[str, str] | None = None) -> dict[str, str]:
    """file name -> content of every export (`versions`: stack -> release to write for)."""
    return {export.file_name: export.render(plan, _version(name, versions)) for name, export in EXPORTS.items()}


def export_notes(plan: Plan, versions: dict[str, str] | None = None) -> list[tuple[str, list[str]]]:
    """(file name, what its stack cannot express) for each export with something to say."""
    notes = [(export.file_name, export.notes(plan, _version(name, versions))) for name, export in EXPORTS.items()]
    return [(name, items) for name, items in notes if items]


def render_export(plan: Plan, name: str, versions: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """One export's text and notes."""
    version = _version(name, versions)
    return EXPORTS[name].render(plan, version), EXPORTS[name].notes(plan, version)
