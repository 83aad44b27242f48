"""The report's arguments (autoplan/report/arguments.py): token counts, GPU counts and names,
prices; and that checking them imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autoplan.errors import UserError
from autoplan.report import arguments


@pytest.mark.parametrize("text,tokens", [("2T", 2 * 10**12), ("300B", 3 * 10**11), ("1.5e12", 15 * 10**11),
                                         ("500m", 5 * 10**8), ("2,000,000", 2 * 10**6), ("7k", 7000)])
def test_parse_tokens(text, tokens):
    assert arguments.parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["0", "-5T", "abc", "", "2X", "0.0001"])
def test_parse_tokens_rejects(text):
    with pytest.raises(UserError, match="--tokens"):
        arguments.parse_tokens(text)


def test_parse_counts():
    assert arguments.parse_counts("128, 64,64") == [64, 128]
    for bad in ("0", "8,x", "", "-8"):
        with pytest.raises(UserError, match="--gpus"):
            arguments.parse_counts(bad)


def test_unknown_gpu():
    with pytest.raises(UserError, match="Unknown GPU 'h1000'"):
        arguments.parse_gpus("h100,h1000")


def test_missing_prices_named_with_fix():
    from autoplan.hardware import load_prices

    gpus = arguments.parse_gpus("h100,v100-sxm2-32gb,l40s")  # the default list leaves v100 and l40s out
    with pytest.raises(UserError) as info:
        arguments.gpu_prices(gpus, load_prices())
    text = str(info.value)
    assert "v100-sxm2-32gb" in text and "l40s" in text and "--price v100-sxm2-32gb=" in text
    assert "h100" not in text.split("(it has")[0]  # only the missing ones are named as missing
    prices = arguments.gpu_prices(gpus, load_prices({"v100": 0.9, "l40s": 1.1}))
    assert prices["v100-sxm2-32gb"] == 0.9 and gpus[0].key in prices


def test_the_arguments_are_checked_without_torch():
    code = "import sys, autoplan.report.arguments, autoplan.commands.report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"], out.stdout + out.stderr[-2000:]
