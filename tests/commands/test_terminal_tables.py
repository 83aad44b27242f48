"""Terminal tables of `gpus` and `report` at 80 and 120 columns: no value cut, broken or wider
than the terminal (values are words like "h100-sxm-80gb" and ranges like "95 min – 2.4 h")."""

from __future__ import annotations

import pytest
from rich.console import Console

from autoplan.commands.gpus import _row, gpu_table
from autoplan.hardware import list_gpus, load_prices


def _render(renderable_or_fn, width: int) -> str:
    console = Console(width=width, record=True, force_terminal=False)
    renderable_or_fn(console)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 120])
def test_gpus_table_keeps_one_line_per_gpu(width):
    prices = load_prices()
    rows = [_row(gpu, prices) for gpu in list_gpus()]

    def show(console):
        table, below = gpu_table(rows, console.width)
        console.print(table)
        for line in below:
            console.print(line)

    text = _render(show, width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width and "…" not in text
    for row in rows:
        # the key and all its numbers on one line, none broken
        (line,) = [line for line in lines if line.startswith(row["key"] + " ")]
        assert f"{row['memory_gib']:,.0f}" in line or f"{row['memory_gib']:.2f}" in line
        price = "-" if row["usd_per_gpu_hour"] is None else f"{row['usd_per_gpu_hour']:.2f}"
        assert f" {price} " in line + " "
        for alias in row["aliases"]:  # in the table (wide) or under it, whole
            assert alias in text.replace("\n", " ")


def _doc(plans: int = 4) -> dict:
    config = {"dp": 16, "tp": 8, "pp": 4, "cp": 2, "ep": 1, "zero_stage": 1, "offload": "none", "micro_batch": 1,
              "schedule": "interleaved-1f1b", "vpp": 4, "precision": "bf16"}
    goodput = {"fraction": 0.953, "checkpoint_interval_s": 5400.0}
    rows = [{"label": f"{n} x h200-sxm-141gb", "fits": True, "frontier": n == 1024, "config": config,
             "step_time_s": 12.3, "mfu": 0.412, "memory_gib_per_gpu": 71.2, "headroom_gib": 60.3,
             "time_to_train_s": 86400 * 41.5, "time_range_s": [86400 * 33.2, 86400 * 49.8],
             "gpu_hours": 1.02e6, "cost_usd": 4.1e6, "cost_range_usd": [3.3e6, 4.9e6], "goodput": goodput,
             "runners_up": []} for n in (1024 * 2**k for k in range(plans))]
    rows.append({"label": "64 x h200-sxm-141gb", "fits": False, "reason": "no configuration fits"})
    return {"kind": "sweep", "model": "llama3.1-405b", "tokens": 15e12, "seq_len": 8192, "global_batch": 2048,
            "precision": "bf16", "price_list": "default", "error": None, "rows": rows,
            "recommendations": {"fastest": {"label": rows[-2]["label"], "why": "shortest time to train"}},
            "assumptions": {"failures_per_gpu_hour": 1.97e-5, "checkpoint_write_bytes_per_s_per_gpu": 1.22e8,
                            "restart_s": 600, "sources": {"failures_per_gpu_hour": "Llama 3"}}}


@pytest.mark.parametrize("width", [80, 120])
def test_report_clusters_fit_the_terminal_and_keep_values_whole(width):
    from autoplan.report.render_terminal import print_report

    text = _render(lambda console: print_report(_doc(), console), width)
    assert max(len(line) for line in text.splitlines()) <= width and "…" not in text
    for whole in ("8192 x h200-sxm-141gb", "1024 x h200-sxm-141gb", "33.2 days – 49.8 days", "$3.30M – $4.90M",
                  "checkpoint", "goodput", "interleaved-1f1b"):
        assert whole in text, whole
