"""`autoplan tune`: run the best few plans on the cluster itself, rank them by measurement.

The cost model picks; a short run decides. `candidates` chooses which plans are worth a run
(those the cost model cannot tell apart from the fastest, and the fastest of each other
parallel layout), `launch` writes each one's job with `generate`'s own code and runs it for a
few steps through its launch.sh, and `refit` turns measured against predicted step times into
a hardware file the next `plan` on this cluster reads.
"""
