"""Runtime families of published runs, accuracy per family, and the runtime defaults they imply."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from autoplan.validate import families
from autoplan.validate.published import candidate_configs, load_runs

RUNS = Path(__file__).resolve().parents[2] / "cost_models" / "validation" / "published_runs.json"


@pytest.mark.parametrize("source, locator, family", [
    ("PyTorch torchtitan docs/performance.md", "pytorch/torchtitan docs/performance.md @ eaea6f6", "torchtitan"),
    ("BigScience BLOOM-176B training README", "bigscience-workshop/bigscience @ 9e64ede", "megatron-deepspeed"),
    ("Some paper", "microsoft/Megatron-DeepSpeed examples", "megatron-deepspeed"),  # not "megatron"
    ("NVIDIA NeMo Framework performance summary", "NVIDIA/NeMo docs", "megatron"),
    ("Korthikanti et al. 2022 (MLSys 2023, arXiv:2205.05198)", "Table 5", "megatron"),
    ("MosaicML llm-foundry benchmarking README", "mosaicml/llm-foundry @ 8c8dd48", "llm-foundry"),
    ("DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437v2)", "§3.1", "other"),
])
def test_family_from_source_text(source, locator, family):
    assert families.run_family({"source": source, "source_locator": locator}) == family


def test_every_repo_run_has_a_family():
    counts = Counter(families.run_family(r) for r in load_runs(RUNS))
    # the 8 torchtitan rows are the family of autoplan's own runtime
    assert families.autoplan_runtime_family() == "torchtitan"
    assert counts["torchtitan"] == 8
    assert counts["megatron"] > counts["llm-foundry"] > counts["megatron-deepspeed"]
    assert sum(counts.values()) == len(load_runs(RUNS))


def _run(family, error, memory=None, feasible=True):
    out = {"family": family, "predicted": {"feasible": feasible}, "error": {"tokens_per_s_per_gpu": error}}
    if memory is not None:
        out["error"]["memory_gib_per_gpu"] = memory
    return out


def test_summary_per_family():
    runs = [_run("megatron", 0.1), _run("megatron", -0.3), _run("megatron", 0.02),
            _run("torchtitan", 0.5, memory=-0.2, feasible=False), _run("torchtitan", -0.1, memory=0.1),
            {"family": "other", "skipped": "why", "predicted": {}, "error": {}}]
    summary = families.by_family(runs)
    assert list(summary) == ["torchtitan", "megatron", "other"]  # rule order, "other" last
    assert summary["other"]["compared"] == 0 and summary["other"]["median_abs_rel_error"] is None
    assert summary["megatron"]["median_abs_rel_error"] == pytest.approx(0.1)
    assert summary["megatron"]["within_25pct_fraction"] == pytest.approx(2 / 3)
    assert summary["megatron"]["memory_median_abs_rel_error"] is None
    assert summary["torchtitan"]["median_abs_rel_error"] == pytest.approx(0.3)
    assert summary["torchtitan"]["memory_median_abs_rel_error"] == pytest.approx(0.15)
    assert summary["torchtitan"]["predicted_infeasible"] == 1


def test_torchtitan_runtime_traits():
    traits = families.runtime_traits("torchtitan")
    assert traits["fp32_module_weights"] is True  # FSDP2 MixedPrecisionPolicy: fp32 shards
    assert traits["selective_policy"] == "op-every-other-mm"
    assert traits["sp_saves_gathered_inputs"] is True  # DTensor sequence parallelism
    assert traits["allocator_reserve_fraction"] == families.allocator_reserve_fraction() > 0
    # torch's eager cross entropy, logits freed before the backward (train.py `del pred`)
    assert traits["fused_vocab_cross_entropy"] is False and traits["loss_keeps_logits"] is False
    # torchtitan shards tok_embeddings as an FSDP unit of its own, gathered again for backward
    assert traits["fsdp_root_regathered"] is True
    # torch's ring attention passes fp32 K/V gradients cp hops; Transformer Engine's (Megatron)
    # passes them in K/V's 16-bit dtype cp - 1 hops
    assert traits["cp_grad_ring"] == "fp32-home"
    # torch's non-reentrant checkpoint stops recomputing once the saved tensors are back;
    # Megatron's reentrant one reruns the whole forward
    assert traits["checkpoint_early_stop"] is True
    assert families.runtime_traits("megatron") == {"fp32_module_weights": False,
                                                   "selective_policy": "attention_core",
                                                   "sp_saves_gathered_inputs": False,
                                                   "optimizer_kernels": "fused",
                                                   "fsdp_buffer_copies": False,
                                                   "fused_vocab_cross_entropy": True,
                                                   "loss_keeps_logits": False,
                                                   "experts_replicated_over_tp": False,
                                                   "fsdp_root_regathered": True,
                                                   "cp_grad_ring": "kv-dtype",
                                                   "checkpoint_early_stop": False,
                                                   "pp_hands_on_side_values": False,
                                                   "float8_weights_per_step": True,
                                                   "float8_casts_fused": True,
                                                   "float8_saved_inputs": True,
                                                   "fused_gated_activation": True}
    # torchao's Float8Linear casts its weight at every forward, its casts fused only when compiled,
    # and saves the bf16 input; Transformer Engine under Megatron keeps the step's float8
    # weights, fuses the casts and saves the float8 input
    assert traits["float8_weights_per_step"] is False and traits["float8_casts_fused"] is False
    assert traits["float8_saved_inputs"] is False
    # eager SwiGLU (torchtitan, and MPT's ungated MLP) vs Megatron-Core's fused bias_swiglu_impl
    assert traits["fused_gated_activation"] is False
    assert families.runtime_traits("llm-foundry")["fused_gated_activation"] is False
    # Megatron's distributed optimizer and torchtitan's FSDP shard expert-parallel experts over
    # the TP ranks too; only autoplan's runtime keeps them whole on each (layers.Runtime default)
    assert traits["experts_replicated_over_tp"] is False


def test_adamw_runs_op_by_op_in_llm_foundry_and_the_torchtitan_runs():
    # Composer's DecoupledAdamW, the MPT yamls' optimizer; torch's foreach AdamW at the two
    # torchtitan commits the rows ran (fused became its default later); Megatron fuses it
    assert families.runtime_traits("llm-foundry")["optimizer_kernels"] == "per-op"
    assert families.runtime_traits("torchtitan")["optimizer_kernels"] == "per-op"
    assert families.runtime_traits("megatron")["optimizer_kernels"] == "fused"


def test_only_fsdp2_copies_through_flat_buffers():
    assert families.runtime_traits("torchtitan")["fsdp_buffer_copies"] is True
    assert families.runtime_traits("llm-foundry")["fsdp_buffer_copies"] is False  # FSDP1 flat parameter


def test_interleaved_torchtitan_run_takes_two_stages_per_rank():
    runs = {r["id"]: r for r in load_runs(RUNS)}
    interleaved = runs["torchtitan_t5_llama31_405b_512gpu_interleaved1f1b"]
    assert {c.vpp for c, _ in candidate_configs(interleaved)} == {2}
    assert {c.vpp for c, _ in candidate_configs(runs["torchtitan_t5_llama31_405b_512gpu_1f1b"])} == {1}
    # a Megatron row that mentions interleaving without a degree is left alone
    megatron = dict(runs["narayanan21_t1_gpt1.7b_32gpu"], notes="interleaved 1F1B")
    assert families.interleaved_default_vpp(megatron) is None


def test_layer_sac_only_for_torchtitan_notes():
    runs = {r["id"]: r for r in load_runs(RUNS)}
    assert families.layer_sac(runs["torchtitan_a100_llama213b_64gpu_lbs2_selectivelayer"])
    assert not families.layer_sac(runs["torchtitan_a100_llama213b_64gpu_lbs2_selectiveop"])
    assert not families.layer_sac(json.loads(json.dumps(runs["korthikanti22_22b_8gpu_seqpar_selective"])))


def test_terminal_prints_the_family_table(tmp_path):
    import os
    import subprocess
    import sys

    runs = {r["id"]: r for r in load_runs(RUNS)}
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": [runs["narayanan21_t1_gpt1.7b_32gpu"]]}))
    out = subprocess.run([sys.executable, "-m", "autoplan", "validate", str(path)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr
    assert "by runtime family" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("│ megatron "))
    assert [c.strip() for c in row.split("│")[1:4]] == ["megatron", "1", "0"]
