"""Runtime family of a published run (Megatron, Megatron-DeepSpeed, torchtitan, ...).

The rules are data (cost_models/validation/runtime_families.toml, with the reason for each):
substrings of the run's `source` and `source_locator`, first match wins, else "other".
The accuracy of the cost model is reported per family, and the error band a plan shows is
that of the family autoplan's own runtime belongs to (`autoplan_runtime` in the same file).
"""

from __future__ import annotations

import functools
import statistics
import tomllib
from typing import Any, Iterable

from autoplan.paths import cost_models_dir

OTHER = "other"


@functools.lru_cache(maxsize=1)
def _rules() -> dict[str, Any]:
    return tomllib.loads((cost_models_dir() / "validation" / "runtime_families.toml").read_text())


def family_rules() -> list[dict[str, Any]]:
    """[{name, match, why}] in the order they are tried."""
    return list(_rules()["family"])


def autoplan_runtime_family() -> str:
    """The family of the runtime autoplan's generated jobs run on."""
    return str(_rules()["autoplan_runtime"])


def runtime_traits(family: str) -> dict[str, Any]:
    """layers.Runtime fields of a family's runtime (the `runtime` table of the rules file);
    Megatron / DeepSpeed-style 16-bit module weights where the family has none."""
    traits = dict(_rules().get("runtime", {}).get(family, {}))
    out: dict[str, Any] = {"fp32_module_weights": bool(traits.get("fp32_module_weights", False))}
    # Megatron's selective recomputation unless the family's rule says otherwise
    out["selective_policy"] = str(traits.get("selective_policy", "attention_core"))
    # Megatron keeps sequence-parallel linear inputs sharded unless the family runs DTensor
    out["sp_saves_gathered_inputs"] = bool(traits.get("sp_saves_gathered_inputs", False))
    # fused AdamW (Megatron's Apex/TE FusedAdam) unless the family's optimizer runs op by op
    out["optimizer_kernels"] = str(traits.get("optimizer_kernels", "fused"))
    # only FSDP2 copies gathered parameters and gradients through flat buffers
    out["fsdp_buffer_copies"] = bool(traits.get("fsdp_buffer_copies", False))
    # Megatron's fused vocab-parallel cross entropy unless the family runs torch's eager one
    out["fused_vocab_cross_entropy"] = bool(traits.get("fused_vocab_cross_entropy", True))
    out["loss_keeps_logits"] = bool(traits.get("loss_keeps_logits", False))
    # expert-parallel experts sharded over the TP ranks too (Megatron's distributed optimizer
    # over the expert-DP group, torchtitan's fully_shard on its expert mesh), not autoplan's layout
    out["experts_replicated_over_tp"] = bool(traits.get("experts_replicated_over_tp", False))
    # ZeRO-3 gathers the embedding and head before backward too unless the family's rule says
    # its FSDP root keeps them gathered (torchtitan shards tok_embeddings as a unit of its own)
    out["fsdp_root_regathered"] = bool(traits.get("fsdp_root_regathered", True))
    # ring attention's backward passes the K/V gradients in K/V's 16-bit dtype (Transformer
    # Engine's, under Megatron-Core) unless the family's rule names its own ring
    out["cp_grad_ring"] = str(traits.get("cp_grad_ring", "kv-dtype"))
    # Megatron's and DeepSpeed's reentrant checkpoint reruns a layer's whole forward unless the
    # family's rule says it recomputes with torch's non-reentrant checkpoint, which stops early
    out["checkpoint_early_stop"] = bool(traits.get("checkpoint_early_stop", False))
    # pipeline stages hand on the hidden states alone, each building its own rotary tables
    # (Megatron's RotaryEmbedding per model chunk, torchtitan's freqs_cis buffer per stage)
    out["pp_hands_on_side_values"] = bool(traits.get("pp_hands_on_side_values", False))
    # Megatron-Core's Transformer Engine modules cast their float8 weights on the step's first
    # micro-batch and keep them for the others (megatron/core/extensions/transformer_engine.py
    # TELinear.forward hands TE is_first_microbatch, then clears it); torchao casts at every forward
    out["float8_weights_per_step"] = bool(traits.get("float8_weights_per_step", True))
    # and fuse the activations' and gradients' casts into their norm, activation and dact
    # kernels (LayerNormLinear, LayerNormMLP); torchao's casts fuse only when compiled
    out["float8_casts_fused"] = bool(traits.get("float8_casts_fused", True))
    # and their linears save the float8 copy of their input for the weight gradient
    # (transformer_engine/pytorch/module/linear.py); torchao's Float8Linear saves the bf16 input
    out["float8_saved_inputs"] = bool(traits.get("float8_saved_inputs", True))
    # Megatron-Core fuses a gated MLP's activation into one kernel that saves its input only
    # (bias_activation_fusion: megatron/core/fusions/fused_bias_swiglu.py); eager PyTorch does not
    out["fused_gated_activation"] = bool(traits.get("fused_gated_activation", True))
    if traits.get("reserved_memory"):
        out["allocator_reserve_fraction"] = allocator_reserve_fraction()
    return out


def allocator_reserve_fraction() -> float:
    """Reserved over allocated memory of the caching allocator (cost_models/allocator_reserve.toml)."""
    data = tomllib.loads((cost_models_dir() / "allocator_reserve.toml").read_text())
    return float(data["reserved_over_allocated_fraction"])


def layer_sac(run: dict[str, Any]) -> bool:
    """torchtitan's layer-level SAC ("selective layer", selective_ac_option = "2" in its
    configs): every second block fully recomputed, the others not at all."""
    return run_family(run) == "torchtitan" and "selective layer" in str(run.get("notes", "")).lower()


def interleaved_default_vpp(run: dict[str, Any]) -> int | None:
    """Stages per rank of a run whose notes name an interleaved schedule but whose `vpp` is
    unstated: its family runtime's default (`interleaved_stages_per_rank`), else None."""
    if run.get("parallel", {}).get("vpp") or "interleaved 1f1b" not in str(run.get("notes", "")).lower():
        return None
    default = _rules().get("runtime", {}).get(run_family(run), {}).get("interleaved_stages_per_rank")
    return int(default) if default else None


def run_family(run: dict[str, Any]) -> str:
    """The runtime family of one runs-file row, from its source and locator text."""
    text = f"{run.get('source', '')} {run.get('source_locator', '')}".lower()
    for rule in family_rules():
        if any(needle in text for needle in rule["match"]):
            return str(rule["name"])
    return OTHER


def family_summary(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy of a group of validated runs (to_dict form): count, median |error| of tokens/s
    per GPU, fraction within 25%, median |error| of memory over the runs that publish it."""
    runs = [r for r in runs if not r.get("skipped")]
    errors = [abs(r["error"]["tokens_per_s_per_gpu"]) for r in runs if "tokens_per_s_per_gpu" in r["error"]]
    memory = [abs(r["error"]["memory_gib_per_gpu"]) for r in runs if "memory_gib_per_gpu" in r["error"]]
    return {
        "count": len(runs),
        "compared": len(errors),
        "predicted_infeasible": sum(1 for r in runs if not r["predicted"]["feasible"]),
        "median_abs_rel_error": statistics.median(errors) if errors else None,
        "within_25pct_fraction": sum(e <= 0.25 for e in errors) / len(errors) if errors else None,
        "memory_compared": len(memory),
        "memory_median_abs_rel_error": statistics.median(memory) if memory else None,
    }


def by_family(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """family_summary per family (runs carry a "family" key), families in rule order."""
    order = [rule["name"] for rule in family_rules()] + [OTHER]
    present = [name for name in order if any(r.get("family") == name for r in runs)]
    return {name: family_summary(r for r in runs if r.get("family") == name) for name in present}
