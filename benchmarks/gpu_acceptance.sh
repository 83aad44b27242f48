#!/usr/bin/env bash
# GPU acceptance check of autoplan's runtime and cost model on one H100/H200-class GPU (about
# 8 minutes, no network): see benchmarks/gpu_acceptance.py. `--dry-run` runs the same path on CPU.
#   bash benchmarks/gpu_acceptance.sh [--dry-run] [--steps N] [--out DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_acceptance.py "$@"
