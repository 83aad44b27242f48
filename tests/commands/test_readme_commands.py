"""Every `autoplan ...` command line in the READMEs exists in the CLI, option by option.

Command lines come from fenced code blocks (complete commands: parsed by click exactly as
the shell would pass them, nothing executed) and from inline code spans (synopses with
placeholders like MODEL and [--json]: the command and each option must exist).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from autoplan.cli import cli

REPO = Path(__file__).resolve().parents[2]
READMES = [REPO / "README.md", *sorted((REPO / "generated").glob("*/README.md"))]
REQUIRED_UNLESS_PLAN = "required unless --plan is given"


def _autoplan_args(words: list[str]) -> list[str] | None:
    """The arguments after `autoplan` (or `python -m autoplan`), None if the words run no autoplan."""
    for i, word in enumerate(words):
        if word == "autoplan" and (i == 0 or words[i - 1] == "-m"):
            return words[i + 1:]
    return None


def fenced_commands(text: str) -> list[list[str]]:
    """Complete command lines of ```bash blocks, continuation lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                args = _autoplan_args(shlex.split(part, comments=True))
                if args:
                    lines.append(args)
    return lines


def inline_commands(text: str) -> list[list[str]]:
    """Synopses in `autoplan ...` code spans, brackets removed ("...", for more options, stays)."""
    out = []
    for span in re.findall(r"`(autoplan [^`]+)`", text):
        words = [w.strip("[]") for w in span.split()]
        out.append([w for w in words if w][1:])
    return out


def _command(name: str) -> click.Command:
    ctx = click.Context(cli)
    command = cli.get_command(ctx, name)
    assert command is not None, f"`autoplan {name}` is in a README but not in the CLI"
    return command


def _option_names(command: click.Command) -> set[str]:
    return {name for p in command.params for name in (*p.opts, *p.secondary_opts) if name.startswith("-")} | {
        "--help", "-h"}


def _check_options(args: list[str]) -> None:
    if args[0].startswith("-"):  # `autoplan --debug ...`
        assert args[0] in {"--debug", "--version", "--help"}, args
        return
    names = _option_names(_command(args[0]))
    for word in args[1:]:
        if word.startswith("-") and not re.fullmatch(r"-?[0-9.]+", word):
            for option in word.split("=")[0].split("/"):
                assert option in names, f"`autoplan {args[0]}` has no {option} (README: autoplan {' '.join(args)})"


def _check_required(args: list[str]) -> None:
    """Options whose help says they are needed unless --plan is given appear without --plan."""
    command = _command(args[0])
    if "--plan" in args or "--help" in args:
        return
    for param in command.params:
        if isinstance(param, click.Option) and REQUIRED_UNLESS_PLAN in (param.help or ""):
            assert set(param.opts) & set(args), f"autoplan {' '.join(args)} lacks {param.opts[-1]}"


def _all(kind) -> list[tuple[str, list[str]]]:
    return [(path.relative_to(REPO).as_posix(), args) for path in READMES for args in kind(path.read_text())]


FENCED, INLINE = _all(fenced_commands), _all(inline_commands)


def test_the_readmes_have_command_lines_to_check():
    # the README's quickstart, walkthrough and existing-configuration blocks, and every job README
    assert len({path for path, _ in FENCED}) == len(READMES)
    assert len(FENCED) >= 10 and len(INLINE) >= 10


@pytest.mark.parametrize("where,args", FENCED, ids=[" ".join(a)[:60] for _, a in FENCED])
def test_fenced_command_lines_parse(where, args):
    _check_options(args)
    _check_required(args)
    command = _command(args[0])
    # click's own parser with the values as the shell passes them: unknown options, bad choices,
    # non-integers and missing required options fail here; nothing runs
    command.make_context(f"autoplan {args[0]}", list(args[1:]))


@pytest.mark.parametrize("where,args", INLINE, ids=[" ".join(a)[:60] for _, a in INLINE])
def test_inline_synopses_name_real_commands_and_options(where, args):
    _check_options(args)
    if "..." not in args and any(word.startswith("--") for word in args):  # a full synopsis
        _check_required(args)


def test_the_checker_catches_a_wrong_readme():
    text = "```bash\nautoplan report m --tokens 1T --gpu h100 --gpus 8 --objective cost\n```\n"
    (args,) = fenced_commands(text)
    with pytest.raises(AssertionError, match="no --objective"):
        _check_options(args)
    with pytest.raises(AssertionError, match="lacks --global-batch"):
        _check_required(["report", "m", "--tokens", "2T", "--gpu", "h100", "--gpus", "64,128"])
    with pytest.raises(AssertionError, match="not in the CLI"):
        _check_options(inline_commands("`autoplan explain MODEL`")[0])
