"""The `autoplan` command line: a thin click group over the library.

Each subcommand lives in `autoplan/commands/<name>.py` as a click command named
`command`, imported only when invoked so `autoplan --help` stays fast. `main()` turns
user errors into one paragraph on stderr and exit status 2 (`--debug` shows the
traceback), and "nothing fits" into exit status 1.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import textwrap

import click

from autoplan import __version__
from autoplan.errors import NoFeasiblePlan, UserError

COMMANDS = {
    "analyze": "Trace a model on the meta device: parameters, FLOPs, activations, structure.",
    "models": "List the built-in model catalog.",
    "gpus": "List the known GPUs and their aliases.",
    "estimate": "Predict step time, MFU and memory per GPU for one parallel configuration.",
    "validate": "Compare the cost model with published training runs (or a generated run).",
    "plan": "Find the fastest (or cheapest) parallel plan with CP-SAT and explain it.",
    "check": "Dry-run a plan's runtime at full size on fake tensors: memory and collectives.",
    "generate": "Write a runnable torchrun job directory for a plan.",
    "report": "Time, GPU-hours and cost across GPU types and cluster sizes, with charts.",
    "calibrate": "Measure this cluster (run under torchrun) and write a hardware file.",
    "tune": "Run the best few plans here for a few steps each and rank them by measurement.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if _command_module_exists(name)]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not _command_module_exists(name):
            return None
        return importlib.import_module(f"autoplan.commands.{name}").command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _command_module_exists(name: str) -> bool:
    return importlib.util.find_spec(f"autoplan.commands.{name}") is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autoplan")
@click.option("--debug", is_flag=True, help="Show tracebacks of errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Plan how to split a model across GPUs before paying for them.

    MODEL, wherever a command takes one, is a Python file, an HF-style config.json,
    or a catalog name (see `autoplan models`).
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _say_error(kind: str, message: str) -> None:
    # names such as h100-sxm-80gb or --gpus-per-node stay whole on one line
    paragraph = textwrap.fill(" ".join(str(message).split()), width=100, break_on_hyphens=False,
                              break_long_words=False)
    click.echo(f"{kind}: {paragraph}", err=True)


def _click_message(exc: click.ClickException) -> str:
    """A usage error as one sentence with where to look, instead of click's usage block."""
    message = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        message = f"{message.rstrip('.')}; `{ctx.command_path} --help` lists the arguments and options"
    return message


def _no_failed_meta_kernel(record: logging.LogRecord) -> bool:
    """False for torch's log of an op that failed under FakeTensorMode (with its traceback):
    the exception it logs reaches the command, which says what failed in one paragraph."""
    return not str(record.msg).startswith("failed while attempting to run meta")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    if not debug:  # a forward failing on fake tensors is reported as one paragraph, not logged
        logging.getLogger("torch._subclasses.fake_tensor").addFilter(_no_failed_meta_kernel)
        # torchao, which transformers imports where it is installed, registers enums the way
        # torch deprecates: a warning per enum that its user can do nothing about
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
        logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA kernels on a machine without them
    try:
        cli.main(args=args, prog_name="autoplan", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        _say_error("error", "aborted")
        sys.exit(1)
    except click.ClickException as exc:
        if debug:
            raise
        _say_error("error", _click_message(exc))
        sys.exit(2)
    except UserError as exc:
        if debug:
            raise
        _say_error("error", str(exc))
        sys.exit(2)
    except NoFeasiblePlan as exc:
        if debug:
            raise
        click.echo(str(exc), err=True)
        sys.exit(1)
    sys.exit(0)
