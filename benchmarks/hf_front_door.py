"""`autoplan plan hf:config.json` on every model type transformers has a causal-LM class for,
at tiny sizes, and what each answered: a plan (exit 0), a one-paragraph refusal (exit 2), or
anything else (another exit status, a traceback, no answer within TIMEOUT_S), which is a bug.

Each config is transformers' default for the model type at the sizes of autoplan's tiny-copy
check (hf_feature_sweep.tiny_default_config); a type whose default config cannot be shrunk
that way (a multimodal config without num_hidden_layers, a validator refusing the sizes) is
listed as skipped. A refusal can be the shrinking's own doing (a rotary or MLA head dimension
the config keeps beside the shrunk head_dim, so the model's forward fails on its own); what is
checked is that it is a refusal. On 2026-12-07 (results/hf_front_door.txt): 136 planned, 32
refused, 32 skipped, no bug. The plans run in this process (`autoplan.cli.main`), 2 CPU ranks, global
batch 4 x 32 tokens; about 5 minutes on 2 cores. Exit status 1 if any answer is a bug.

    python benchmarks/hf_front_door.py                 # every model type
    python benchmarks/hf_front_door.py llama4 olmoe    # these
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from hf_feature_sweep import tiny_default_config

TIMEOUT_S = 180


class _Late(Exception):
    pass


def _late(*_) -> None:
    raise _Late()


def plan_answer(config_dir: Path) -> tuple[object, str, bool]:
    """(exit status, what it wrote to stderr, whether a traceback was printed)."""
    from autoplan.cli import main

    err, out = io.StringIO(), io.StringIO()
    signal.signal(signal.SIGALRM, _late)
    signal.alarm(TIMEOUT_S)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            main(["plan", f"hf:{config_dir}/config.json", "--gpu", "cpu", "--gpus", "2",
                  "--global-batch", "4", "--seq-len", "32", "-o", str(config_dir / "plan.json")])
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    except _Late:
        code = "timeout"
    except BaseException as exc:  # a bug: nothing may escape the CLI but SystemExit
        code = f"raised {type(exc).__name__}"
    finally:
        signal.alarm(0)
    return code, " ".join(err.getvalue().split()), "Traceback" in err.getvalue() + out.getvalue()


def main(model_types: list[str]) -> int:
    os.environ["AUTOPLAN_CACHE"] = "0"  # every config traced, none read back
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    bugs, counts = 0, {"plan": 0, "refused": 0, "skipped": 0}
    print(f"{'model type':<28} {'answer':<8} {'s':>5}  plan or reason")
    with tempfile.TemporaryDirectory(prefix="hf_front_door_") as tmp:
        for model_type in model_types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            folder = Path(tmp) / model_type
            try:
                tiny_default_config(model_type).save_pretrained(folder)
            except Exception as exc:  # the benchmark's shrinking, not autoplan
                counts["skipped"] += 1
                print(f"{model_type:<28} {'skipped':<8} {'':>5}  {type(exc).__name__}: {str(exc).splitlines()[0][:90]}")
                continue
            start = time.perf_counter()
            code, message, traceback = plan_answer(folder)
            seconds = time.perf_counter() - start
            if code == 0 and not traceback:
                counts["plan"] += 1
                plan = json.loads((folder / "plan.json").read_text())
                detail = " ".join(f"{axis}{plan[axis]}" for axis in ("dp", "tp", "pp", "cp", "ep"))
            elif code == 2 and not traceback:
                counts["refused"] += 1
                detail = message[:150]
            else:
                bugs += 1
                detail = f"BUG{' (traceback)' if traceback else ''}: {message[-200:]}"
            print(f"{model_type:<28} {str(code):<8} {seconds:5.1f}  {detail}", flush=True)
    print(f"\n{counts['plan']} planned, {counts['refused']} refused in one paragraph, "
          f"{counts['skipped']} skipped, {bugs} bugs")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
