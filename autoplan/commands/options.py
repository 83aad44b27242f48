"""Click options shared by several commands, defined once.

An option that means the same thing in two commands is the same object here, so its name
and help text cannot drift apart (a test checks the README's command lines against them).
"""

from __future__ import annotations

import click

from autoplan.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_SEQ_LEN, MAX_WIDTH, check_at_most


def at_most(limit: int):
    """A callback refusing a value above `limit` (autoplan/limits.py) before any work."""
    def check(ctx: click.Context, param: click.Parameter, value):
        check_at_most(param.opts[0], value, limit)
        return value

    return check


PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16", "fp8")
MAX_TOP = 50  # runners-up a table can show; each costs search time
FIX_KEYS = ("tp", "pp", "cp", "dp", "ep", "zero", "micro-batch", "schedule", "vpp", "offload", "recompute",
            "precision", "float8_recipe")

model_argument = click.argument("model", metavar="MODEL")
seq_len_option = click.option("--seq-len", type=int, default=None, callback=at_most(MAX_SEQ_LEN),
                              help="Sequence length in tokens (default: the model's, else 2048; never more "
                                   "than its position table).")
batch_size_option = click.option("--batch-size", type=int, default=1, show_default=True,
                                 callback=at_most(MAX_GLOBAL_BATCH),
                                 help="Sequences per step.")
image_size_option = click.option(
    "--image-size", type=int, default=None, callback=at_most(MAX_WIDTH),
    help="Image side in pixels, for models that take images (default: the model's, else 224).")
global_batch_option = click.option("--global-batch", type=int, required=True, callback=at_most(MAX_GLOBAL_BATCH),
                                   help="Global batch in sequences per optimizer step.")
global_batch_unless_plan_option = click.option(
    "--global-batch", type=int, default=None, callback=at_most(MAX_GLOBAL_BATCH),
    help="Global batch in sequences per optimizer step (required unless --plan is given).")
gpu_option = click.option("--gpu", "gpu", default=None,
                          help="GPU name or alias (see `autoplan gpus`), e.g. h100, a100-sxm4-80gb, cpu.")
gpu_list_option = click.option("--gpu", "gpu", default=None,
                               help="GPU types separated by commas (see `autoplan gpus`), e.g. "
                                    "h100,a100-sxm4-80gb,mi300x.")
hardware_option = click.option("--hardware", type=click.Path(dir_okay=False), default=None,
                               help="A hardware/cluster TOML file (e.g. from `autoplan calibrate`) instead of --gpu.")
gpus_option = click.option("--gpus", type=int, required=True, callback=at_most(MAX_GPUS), help="Number of GPUs (ranks).")
gpus_unless_plan_option = click.option("--gpus", type=int, default=None, callback=at_most(MAX_GPUS),
                                       help="Number of GPUs (ranks) (required unless --plan is given).")
gpus_per_node_option = click.option("--gpus-per-node", type=int, default=None, callback=at_most(MAX_GPUS),
                                    help="GPUs per node (default: the GPU's typical system).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
inter_node_bandwidth_option = click.option(
    "--inter-node-bandwidth", type=float, default=None, metavar="GB/S",
    help="Scale-out (NIC) bandwidth per GPU, one direction, in GB/s (default: the GPU's typical "
         "system, e.g. 50 = 400 Gb/s per H100).")
memory_headroom_option = click.option(
    "--memory-headroom", type=float, default=None, metavar="GIB",
    help="GiB of each GPU's memory a plan leaves free for the allocator's fragmentation and memory "
         "spikes (default: 10% of the GPU's memory, cost_models/memory_headroom.toml; 0 lets a plan "
         "fill the GPU to the estimate).")
precision_option = click.option("--precision", type=click.Choice(PRECISION_CHOICES), default="bf16",
                                show_default=True, help="Training precision; auto lets the solver pick bf16 or fp8.")
compile_option = click.option(
    "--compile", "compile_blocks", is_flag=True,
    help="Run each repeated block under torch.compile in the job (torchtitan's per-block compile); the "
         "cost model then counts its fused kernels. Compiling takes minutes at start-up on a large model.")
fix_option = click.option("--fix", multiple=True, metavar="KEY=VALUE",
                          help="Fix a choice (repeatable): " + ", ".join(FIX_KEYS) + ".")


def top_option(default: int, per_cluster: bool = False):
    """--top: `plan` shows 3 runners-up by default; a `report` sweep none (each costs search time)."""
    where = " per cluster" if per_cluster else ""
    return click.option("--top", type=click.IntRange(0, MAX_TOP), default=default, show_default=True,
                        help=f"Runners-up to show{where}.")


def time_limit_option(per_cluster: bool = False):
    """--time-limit: the search's, for `plan` / `generate`, or each cluster's in a `report` sweep."""
    where = " of each cluster's search" if per_cluster else " of the search"
    return click.option("--time-limit", type=float, default=None, metavar="SECONDS",
                        help=f"Time limit{where}, in seconds (default 60); a search it stops shows the best "
                             "plan found, FEASIBLE, and how many configurations it searched.")


stack_version_option = click.option(
    "--stack-version", "stack_versions", multiple=True, metavar="STACK=VERSION",
    help="Write another stack's file for this release of it (repeatable), e.g. torchtitan=0.2.2 "
         "(default: the current release; names that changed between releases follow it).")
trust_plan_model_option = click.option(
    "--trust-plan-model", is_flag=True,
    help="Load the model file the plan names even when its bytes differ from those the plan recorded "
         "(or it recorded none); without it, give MODEL on the command line for such a plan.")


def _set_load_timeout(ctx: click.Context, param: click.Parameter, seconds: float) -> None:
    from autoplan.models.user_code import set_load_timeout

    try:
        set_load_timeout(seconds)
    except Exception as exc:
        raise click.BadParameter(str(exc).removeprefix("--load-timeout "), ctx, param) from None


load_timeout_option = click.option(
    "--load-timeout", type=float, default=120.0, show_default=True, metavar="SECONDS", expose_value=False,
    callback=_set_load_timeout,
    help="Time limit for each step of running a model file's code: its import, build_model() and the "
         "traced forward.")
