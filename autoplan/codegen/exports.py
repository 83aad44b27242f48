"""The plan in the configuration formats of other training stacks, one registry for all of them.

`autoplan generate` writes each file beside the job, `autoplan plan --format NAME` prints one,
and both list (in the file's header and on the terminal) what the stack cannot express.
"""

from __future__ import annotations

import json
from typing import Callable, NamedTuple

from autoplan.codegen.deepspeed import ds_config, ds_config_notes
from autoplan.codegen.megatron import megatron_args, megatron_notes
from autoplan.codegen.torchtitan import torchtitan_notes, torchtitan_toml
from autoplan.plan import Plan


class Export(NamedTuple):
    file_name: str
    stack: str
    render: Callable[[Plan], str]
    notes: Callable[[Plan], list[str]]


def _ds_json(plan: Plan) -> str:
    return json.dumps(ds_config(plan), indent=2) + "\n"


EXPORTS = {
    "torchtitan": Export("torchtitan.toml", "torchtitan", torchtitan_toml, torchtitan_notes),
    "megatron": Export("megatron.args", "Megatron-LM", megatron_args, megatron_notes),
    "deepspeed": Export("ds_config.json", "DeepSpeed", _ds_json, ds_config_notes),
}


def export_files(plan: Plan) -> dict[str, str]:
    """file name -> content of every export."""
    return {export.file_name: export.render(plan) for export in EXPORTS.values()}


def export_notes(plan: Plan) -> list[tuple[str, list[str]]]:
    """(file name, what its stack cannot express) for each export with something to say."""
    notes = [(export.file_name, export.notes(plan)) for export in EXPORTS.values()]
    return [(name, items) for name, items in notes if items]
