"""Terminal report: rich tables of the same numbers as the Markdown and HTML reports."""

from __future__ import annotations

from typing import Any

from autoplan.report.formatting import count, degrees, duration, pct, setup, time_range, usd, usd_range


def print_report(doc: dict[str, Any], console) -> None:
    """Print a sweep or plan document (see document.py) with rich."""
    from rich.table import Table

    console.print(f"[bold]autoplan report: {doc['model']}[/]  {count(doc['tokens'])} tokens, seq {doc['seq_len']}, "
                  f"global batch {doc['global_batch']}, {doc['precision']}, prices {doc['price_list']}")
    err = doc["error"]
    console.print(f"How sure: {err['source']}; ranges are ±{pct(err['relative'])}"
                  + (" [red](stale: cost model changed since)[/]" if err["stale"] else "")
                  if err else "How sure: no measured error available; point estimates only")
    if doc["kind"] == "sweep":
        rec = Table(title="Recommendations")
        for col in ("objective", "cluster", "why"):
            rec.add_column(col)
        for name, r in doc["recommendations"].items():
            rec.add_row(name, r["label"] or "none", r["why"])
        console.print(rec)
        for name, r in doc["recommendations"].items():
            if r.get("generate"):
                console.print(f"{name}: the job, with sky.yaml and pytorchjob.yaml:", markup=False)
                console.print(f"  {r['generate']}", markup=False, soft_wrap=True)
        console.print(_clusters_table(doc))
        for r in doc["rows"]:
            if not r["fits"]:
                console.print(f"  {r['label']} does not fit: {r['reason']}")
    if doc.get("detail"):
        _print_detail(doc["detail"], console)
    a = doc["assumptions"]
    console.print(f"Assumptions: {a['failures_per_gpu_hour']:.3g} failures per GPU-hour "
                  f"({a['sources']['failures_per_gpu_hour']}); checkpoint write "
                  f"{a['checkpoint_write_bytes_per_s_per_gpu'] / 1e6:.0f} MB/s per GPU; "
                  f"restart {duration(a['restart_s'])}.")


def _clusters_table(doc: dict[str, Any]):
    from rich.table import Table

    table = Table(title="Clusters (* = on the Pareto frontier of time vs cost)")
    for col in ("cluster", "plan", "step", "MFU", "GiB used / free", "time to train", "GPU-hours", "cost",
                "goodput", "checkpoint every"):
        table.add_column(col, justify="left" if col in ("cluster", "plan") else "right")
    for r in doc["rows"]:
        if not r["fits"]:
            table.add_row(r["label"], "[dim]does not fit (below)[/]", *[""] * 8)
            continue
        table.add_row(("* " if r["frontier"] else "") + r["label"], f"{degrees(r['config'])}\n{setup(r['config'])}",
                      duration(r["step_time_s"]), pct(r["mfu"]),
                      f"{r['memory_gib_per_gpu']:.1f} / {r['headroom_gib']:.1f}",
                      f"{duration(r['time_to_train_s'])}\n[dim]{time_range(r['time_range_s'])}[/]",
                      count(r["gpu_hours"]), f"{usd(r['cost_usd'])}\n[dim]{usd_range(r['cost_range_usd'])}[/]",
                      pct(r["goodput"]["fraction"]), duration(r["goodput"]["checkpoint_interval_s"]))
    return table


def _print_detail(d: dict[str, Any], console) -> None:
    from rich.table import Table

    from autoplan.report.charts import MEMORY_PARTS

    g = d["goodput"]
    head = Table(title=d["title"], show_header=False)
    head.add_row("plan", f"{degrees(d['config'])}, {setup(d['config'])}, {d['num_microbatches']} micro-batch"
                     + ("es" if d["num_microbatches"] != 1 else ""))
    head.add_row("step time", f"{duration(d['step_time_s'])} ({count(d['tokens_per_s_per_gpu'])} tokens/s per GPU, "
                              f"MFU {pct(d['mfu'])})")
    head.add_row("memory per GPU", f"{d['memory_gib_per_gpu']:.1f} of {d['capacity_gib']:.1f} GiB "
                                   f"({d['headroom_gib']:.1f} GiB headroom)")
    head.add_row("time to train", f"{duration(d['time_to_train_s'])} ({time_range(d['time_range_s'])}), "
                                  f"{d['steps']:,} steps")
    head.add_row("cost", f"{usd(d['cost_usd'])} ({usd_range(d['cost_range_usd'])}), {count(d['gpu_hours'])} GPU-hours")
    head.add_row("checkpoints", f"{g['checkpoint_bytes'] / 1e9:.0f} GB, {duration(g['checkpoint_write_s'])} to write; "
                                f"Young/Daly interval {duration(g['checkpoint_interval_s'])} "
                                f"(every {g['checkpoint_interval_steps']} steps)")
    head.add_row("interruptions", f"job MTBF {duration(g['job_mtbf_s'])}, "
                                  f"{g['expected_interruptions'] or 0:.1f} expected, "
                                  f"{duration(g['lost_s_per_interruption'])} of work lost each; "
                                  f"goodput {pct(g['fraction'])}")
    console.print(head)
    mem = Table(title="Memory per pipeline stage (GiB per GPU)")
    for col in ("stage", "blocks", *MEMORY_PARTS, "total"):
        mem.add_column(col, justify="right")
    for s in d["per_stage"]:
        mem.add_row(str(s["stage"]), str(s["blocks"]),
                    *[f"{s['memory_breakdown_gib'].get(p, 0):.2f}" for p in MEMORY_PARTS], f"{s['memory_gib']:.2f}")
    console.print(mem)
    step = Table(title="Step time")
    for part in [*d["step_parts_s"], "step"]:
        step.add_column(part, justify="right")
    step.add_row(*[duration(s) for s in d["step_parts_s"].values()], duration(d["step_time_s"]))
    console.print(step)
