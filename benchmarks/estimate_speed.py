"""Speed target: `autoplan estimate` for Llama 3.1 405B on 16,384 GPUs answers in < 3 s.

Runs the real command line in a fresh process (imports, trace, estimate) a few times and
prints a table of wall times.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time

COMMANDS = {
    "llama3.1-405b 16384 x h100 tp8 pp16 vpp4": [
        "estimate", "llama3.1-405b", "--gpu", "h100", "--gpus", "16384", "--tp", "8", "--pp", "16",
        "--vpp", "4", "--global-batch", "2048", "--seq-len", "8192", "--recompute", "full", "--json"],
    "llama3.1-8b 8 x h100": [
        "estimate", "llama3.1-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64", "--json"],
}
TARGET_S = 3.0
REPEATS = 3


def main() -> None:
    # wall time depends on machine load; CPU time (user + sys of the child) does much less
    print(f"{'command':45s} {'best s':>8s} {'worst s':>8s} {'cpu s':>7s} {'target':>7s}")
    for name, args in COMMANDS.items():
        times, cpu = [], []
        for _ in range(REPEATS):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True)
            times.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            if out.returncode != 0:
                raise SystemExit(f"{name} failed: {out.stderr}")
        ok = "ok" if min(times) < TARGET_S else "SLOW"
        print(f"{name:45s} {min(times):8.2f} {max(times):8.2f} {min(cpu):7.2f} {ok:>7s}")


if __name__ == "__main__":
    main()
