"""Options shared by the planning commands: present wherever they make sense, same name, same help."""

from __future__ import annotations

import itertools
import json

import click
import pytest

from autoplan.cli import cli

PLANNING = ("analyze", "estimate", "plan", "generate", "report", "validate")
# every command that plans or costs on a cluster takes the cluster the same way
CLUSTER = {"--gpu", "--hardware", "--gpus", "--gpus-per-node", "--inter-node-bandwidth", "--memory-headroom",
           "--global-batch", "--seq-len", "--precision"}
SEARCH = CLUSTER | {"--fix", "--time-limit"}
# the same name with a different meaning, and why
DIFFERENT_HELP = {
    "--gpu": "report sweeps a comma-separated list of GPU types",
    "--gpus": "report sweeps a comma-separated list of counts",
    "--plan": "each command does its own thing with a plan file",
    "--output": "each command writes its own kind of file",
    "--force": "each command overwrites its own kind of file",
    "--precision": "estimate costs one given precision (no auto)",
    "--global-batch": "estimate also takes it from an imported configuration",
    "--format": "plan prints another stack's configuration, report a document format",
    "--top": "report shows runners-up per cluster of its sweep",
    "--time-limit": "report limits each cluster's search of its sweep",
}
DIFFERENT_DEFAULT = {"--top": "a report sweep searches for each cluster's best alone unless asked (faster)"}


def _command(name: str) -> click.Command:
    return cli.get_command(click.Context(cli), name)


def _options(name: str) -> dict[str, click.Option]:
    return {opt: p for p in _command(name).params if isinstance(p, click.Option) for opt in p.opts
            if opt.startswith("--")}


def test_search_options_exist_on_every_searching_command():
    for name in ("plan", "generate", "report"):
        assert SEARCH <= set(_options(name)), (name, SEARCH - set(_options(name)))
    assert CLUSTER <= set(_options("estimate"))
    assert "--top" in _options("plan") and "--top" in _options("report")


@pytest.mark.parametrize("first,second", list(itertools.combinations(PLANNING, 2)))
def test_shared_options_have_the_same_help(first, second):
    a, b = _options(first), _options(second)
    for name in sorted(set(a) & set(b) - set(DIFFERENT_HELP)):
        assert a[name].help == b[name].help, f"{name}: {first} says {a[name].help!r}, {second} {b[name].help!r}"
        assert a[name].type.name == b[name].type.name, name
        assert a[name].default == b[name].default or name in DIFFERENT_DEFAULT, name


def test_every_option_has_help():
    for name in PLANNING:
        missing = [p.opts[-1] for p in _command(name).params if isinstance(p, click.Option) and not p.help]
        assert not missing, f"{name}: {missing} have no help text"


def test_fix_keys_are_spelled_as_the_options(run_cli):
    help_text = _options("plan")["--fix"].help
    assert "micro-batch" in help_text and "micro_batch" not in help_text
    args = ("plan", "tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8",
            "--seq-len", "32", "--top", "0", "--json")
    for spelling in ("micro-batch", "micro_batch"):  # the old spelling keeps working
        code, out, err = run_cli(*args, "--fix", f"{spelling}=4")
        assert code == 0, err
        assert json.loads(out)["plan"]["micro_batch"] == 4


def _help(name: str) -> str:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, [name, "--help"], prog_name="autoplan")
    assert result.exit_code == 0
    return " ".join(result.output.split())


def test_usage_lines_mark_what_is_optional(run_cli):
    assert "Usage: autoplan validate [OPTIONS] [RUNS.json]" in _help("validate")
    assert "(required unless --plan is given)" in _help("report")
    assert _options("report")["--global-batch"].help.endswith("(required unless --plan is given).")
    code, _, err = run_cli("report", "tiny-gpt", "--tokens", "1B", "--gpu", "cpu", "--gpus", "4")
    assert code == 2 and "--global-batch" in err
    code, _, err = run_cli("validate")
    assert code == 2 and "--run DIR" in err
