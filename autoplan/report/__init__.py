"""`autoplan report`: one training job planned on many clusters, priced for the whole run.

- arguments.py: the command's token counts, GPU counts and names and prices, checked before
  anything imports torch (a mistyped GPU is answered at once).

- sweep.py: plan every (GPU type, count) on one traced graph, price it, Pareto frontier,
  recommendations (fastest, cheapest, under --budget, under --deadline).
- goodput.py: checkpoints, interruptions and restarts (Young/Daly interval, Llama 3 failure rate).
- accuracy.py (import it directly; it is also a script): the cost model's measured error on
  published runs, as a range on time and cost.
- timeline.py: pipeline schedules (gpipe, 1f1b, interleaved) simulated for the timeline chart.
- document.py: the report as plain data (JSON); charts.py, render_files.py, render_terminal.py:
  SVG charts, HTML/Markdown (templates/report.*.j2) and rich tables.
"""
