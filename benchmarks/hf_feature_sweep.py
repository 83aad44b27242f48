"""Sweep transformers families over the runtime's feature settings and print whether each
multi-rank job trains as its family's one-rank job does.

Each family is a tiny config (hidden 64, 4 layers, dropouts 0) built by transformers'
`AutoConfig.for_model`; each setting is a plan fixed on 2 CPU ranks (gloo). A job is planned,
generated and launched as a user does it (`autoplan plan -o`, `autoplan generate --plan`,
`launch.sh`), with the plan file's optimizer set to a constant learning rate that moves the
loss (5e-3, no warm-up, no clipping). Compared with the one-rank job of the same global batch:
every step's loss, and the global gradient norm before clipping (metrics.jsonl), which shows a
gradient of the wrong scale that Adam's normalised update would hide.

Tolerances, fp32, 3 steps: losses 1e-5, norms 1e-3. The largest gaps seen over the first 12
families x 7 settings (2026-12) were 3.0e-6 in a loss and 1.8e-4 in a norm, both Phi-3 at tp2,
whose split matmuls sum in another order (its one-rank job alone moves the last norm by 4e-5
between micro-batches of 4, 2 and 1). A wrong gradient (a missing reduction, a gradient summed
where it is averaged) is off by 1e-2 or more from the first updated step.

A family not in FAMILIES is any transformers model type, built from its config's defaults at
the sizes of autoplan's tiny-copy check (pipeline_hf.shrink_config), dropouts 0; the setting
`chosen` fixes nothing but fp32 (the planner's own plan on 2 ranks). Over 25 such families
(2026-12-07, `--settings chosen,tp2_full`) every job trained within the tolerances except
three that are not wrong: PhiMoE draws its experts by Gumbel sampling in training (its losses
differ from the first step, README: Limits), Hunyuan-V3 at tp2 ends 1.3e-5 apart in a loss
after 3 steps (its step-0 loss equal, grad norm 6e-8: an MoE's top-2 routing flips on rounding
once the weights move, as the parity suite's Qwen2-MoE tolerance allows), and CPM-Ant (its
embedding std 1.0 gives losses of 23; its dp2 run alone ends 1.3e-3 apart in a grad norm).
Of 16 more (`--settings chosen,tp2_full`: SarvamMoE, Aria, Cohere2, CTRL, EXAONE-4, GPT-Neo,
GLM-4, Phi, VaultGemma, OLMo-3, Moshi, HRM, BigBird, BART, InternLM3, Jais2) one was wrong:
Moshi at tp2 (losses 1.9e-3 apart from the first step), whose MLP views its [gate | up]
column as (batch, seq, 2, ffn); split per part since (trace/facts.py), 8.6e-8. Of 34 more
(2026-12-07, `--settings chosen,tp2_full`: Apertus-1.5, BEAM, Ergo, Falcon-Mamba, Flint, GPT-SW3,
GPT-NeoX-Japanese, Granite-SWA, GraniteMoE-SWA, Hunyuan-V4, HyperCLOVA X, three Inkling text
models, IQuest-Coder, Kolibri, Laguna, Lara-mini, LFM3, Mellum, MiniMax-M3 text, Ministral-3,
ModernBERT decoder, nanochat, Param2-MoE, Qwen3.5 and its MoE, Qwen4-exp, Solar-Open, CWM,
BigBird-Pegasus, Blenderbot, Blenderbot-small, MVP: chosen only) every job that trained was
within 2.6e-7 in losses and 4.5e-5 in norms (Hunyuan-V4); 14 refused tp2 at plan time, each
naming why. Of 8 more (TrOCR, RemBERT, XLM-RoBERTa-XL, RoBERTa-PreLayerNorm, BERT-generation,
CamemBERT, Data2Vec-text, XLM-RoBERTa) every job was within 2.6e-7 and 8.2e-7; TrOCR and RemBERT
refused tp2. RoBERTa-PreLayerNorm refused it too until its classes, named for a norm, stopped
counting as norms (trace/ops.is_norm_type); its tp2 since: 8.6e-8 and 8.9e-8. GPT-OSS,
GraniteMoE-SWA and MiniMax-M3's text model, refused tp2 while an MoE layer's TP style was tied to
EP's expert layouts (trace/facts.py: style "moe"), train at tp2_full and tp2_selective within
8.6e-8 in losses and 7.9e-7 in norms. RemBERT, refused tp2 while its attention viewed its output
by the whole model's all_head_size, trains at tp2_full within 1.9e-7 and 1.4e-6.

Context and expert parallelism (2026-12-07). `cp2` (ring attention) over 13 of FAMILIES:
llama_tied, qwen3, gpt2, gpt_neox, olmo2, stablelm and bert within 1.7e-7 in losses and 4.2e-6
in norms; gemma2 (soft-capped eager attention), bloom, mpt, falcon_alibi (ALiBi) and t5
(relative bias) refused at plan time; phi3 ended 3.5e-5 and 2.4e-3 apart after 3 steps from an
equal step 0 (loss 0, norm 7e-8), its rounding amplified as its dp2 run's is (1.8e-4 in a norm),
while the parity suite's hf_phi3_cp2, every weight compared after 4 steps, is within 8.6e-8,
3.9e-7 and 2.5e-6. Over 12 more (transformers' defaults: qwen2, mistral, starcoder2, cohere,
granite, glm, smollm3, olmo3, exaone4, helium, opt, persimmon) cp2 is within 3.4e-7 and 1.2e-5;
xglm (eager attention, no SDPA) is refused at plan time. Over 5 more (falcon, whose
head_dim, a property of its config, the tiny-copy sizes now leave to it; seed_oss, arcee,
gemma, llama) cp2 is within 1.7e-7 and 1.8e-6; hunyuan_v1_dense's default config does not
build in transformers itself (head_dim None) and is refused at plan time naming that. Over the
sequence-mixing families (2026-12-07): mamba, falcon_mamba, jamba, falcon_h1, recurrent_gemma,
nemotron_h and zamba are refused cp2 at plan time (a mixer other than attention sees only the
rank's tokens); zamba2 is refused at plan time (its forward reads values); lfm2's tiny copy
keeps two attention layers and trains within 8.6e-8 (with a conv layer it is refused cp2,
naming model.layers.0.conv); bamba's, granitemoehybrid's and mamba2's shrunk defaults do not
build (a "not built" row), nor does lfm2_moe's default in transformers. `ep2` over 10 more MoE
types (2026-12-07): GraniteMoE-SWA, Qwen3.5-MoE text and Jamba within 8.6e-8 in losses and
1.2e-7 in norms; PhiMoE 5.9e-4 and 2.9e-3, its Gumbel-sampled routing (README: Limits, as
under `chosen`); dots1's and hunyuan_v1_moe's defaults do not build in transformers; GLM-MoE-DSA
refused (its forward reads values); the text halves of GLM-4V-MoE and Qwen3-VL-MoE and
switch_transformers refused, naming the class to put in the config's architectures list. `ep2` (dp2 x ep2) over 22 MoE families:
Mixtral, DeepSeek-V3, OLMoE, Qwen2-MoE, Qwen3-MoE, Granite-MoE, GraniteMoE-shared,
ERNIE-4.5-MoE, GLM-4-MoE, FlexOlmo, MiniMax, MiniMax-M2, AfMoE, Cohere2-MoE, EXAONE-MoE,
MiniCPM5-MoE, Param2-MoE, Sarvam-MoE, GPT-OSS, Qwen3-Next, and DeepSeek-V2 and GLM-4-MoE-lite
(tiny configs written out: the shrunk defaults give MLA other head counts than its K/V) within
3.4e-7 in losses and 3.4e-6 in norms; Llama-4's experts (routed outside their module) refused EP
at plan time, JetMoE and LongCat-Flash refused at plan time (their forwards read values). DBRX's
experts, stacked along dim 0 of 2-D weights, were not found, and its model (which states the
expert count) was costed as one routing module: blocks of no FLOPs, planned with exit 0; the
trace now finds them (trace/fallback.flattened_experts), refuses EP for the layout and plans the
rest.

MLA families (2026-12-08). Their defaults state rotary and latent sizes per head; cut to the tiny
head size of 16 they did not run, and the tiny-copy check refused a real DeepSeek-V2 config's
pipeline split for the same reason (pipeline_hf: the copy is now made again at the model's own
head size). At their own head size: MiniCPM3, GLM-4-MoE-lite, Youtu, Sarvam-MLA and DeepSeek-V3
at chosen and pp2_zero_bubble, and the first four at tp2_full, within 9.0e-6 in losses and
4.7e-4 in norms (Sarvam-MLA at tp2, an MoE whose routing flips on rounding; MiniCPM3 at tp2
7.6e-6 and 6.6e-5, its step-0 loss and norm within 9.7e-8 and 5.4e-7, drifting as its dp2
zero1 run does: 3.2e-7 and 3.0e-5 after 3 steps); GLM-4-MoE-lite and Sarvam-MLA at
ep2 within 1.0e-6 and 4.8e-5; LongCat-Flash at chosen 8.5e-8 (its tiny default holds one
block, so pp2 is refused); CodeGen (its qkv_proj in 4 model-parallel groups) at chosen and
tp2_full 2.0e-7 and 3.6e-5; AXK2 and DeepSeek-V3.2 at chosen within 8.4e-8, both refusing
tp2 at plan time, naming why. Grouped routing states its groups in terms of the expert count
(n_group 8 beside 4 tiny experts did not run), so the copy keeps the model's experts too, and
its size limit is 160M parameters (DSA's indexer is not shrunk): BEAM, AXK1, DeepSeek-V3.2 and
Bailing-hybrid at chosen and pp2_zero_bubble within 1.2e-6 in losses and 2.2e-5 in norms.

    python benchmarks/hf_feature_sweep.py                  # everything: about 100 jobs, 1.5 h on 2 cores
    python benchmarks/hf_feature_sweep.py --families llama_tied,mixtral --settings tp2_full,pp2_zero_bubble
    python benchmarks/hf_feature_sweep.py --families olmoe,jamba --settings chosen,tp2_full
    python benchmarks/hf_feature_sweep.py --families qwen3_moe,gpt_oss --settings cp2,ep2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

LOSS_TOLERANCE = 1e-5
NORM_TOLERANCE = 1e-3
GLOBAL_BATCH, SEQ_LEN, LR = 4, 32, 5e-3

DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               max_position_embeddings=128, vocab_size=256)
FAMILIES = {
    "llama_tied": ("llama", dict(DECODER, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(DECODER, num_key_value_heads=2, head_dim=16)),
    "gemma2": ("gemma2", dict(DECODER, num_key_value_heads=2, head_dim=16, sliding_window=16,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                              query_pre_attn_scalar=16)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=4, n_head=4, n_positions=128, vocab_size=256,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "phi3": ("phi3", dict(DECODER, num_key_value_heads=4, resid_pdrop=0.0, embd_pdrop=0.0,
                          attention_dropout=0.0, pad_token_id=None, bos_token_id=None, eos_token_id=None)),
    "gpt_neox": ("gpt_neox", dict(DECODER, rotary_pct=0.25, use_parallel_residual=True,
                                  hidden_dropout=0.0, attention_dropout=0.0)),
    "mixtral": ("mixtral", dict(DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("deepseek_v3", dict(DECODER, moe_intermediate_size=32, n_routed_experts=4,
                                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
                                        num_key_value_heads=4)),
    "olmo2": ("olmo2", dict(DECODER, num_key_value_heads=4)),
    "stablelm": ("stablelm", dict(DECODER, num_key_value_heads=4, partial_rotary_factor=0.25,
                                  hidden_dropout=0.0, attention_dropout=0.0)),
    "bert": ("bert", dict(DECODER, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          architectures=["BertForMaskedLM"])),
    "t5": ("t5", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                      vocab_size=256, dropout_rate=0.0, architectures=["T5ForConditionalGeneration"])),
    # ALiBi, a bias of every head built by the model: BLOOM folds heads into the batch of
    # baddbmm, MPT writes its attention out, old-layout Falcon adds it to the SDPA mask
    "bloom": ("bloom", dict(hidden_size=64, n_layer=4, n_head=4, vocab_size=256, hidden_dropout=0.0,
                            attention_dropout=0.0)),
    "mpt": ("mpt", dict(d_model=64, n_layers=4, n_heads=4, vocab_size=256, max_seq_len=128, expansion_ratio=2,
                        resid_pdrop=0.0, emb_pdrop=0.0)),
    "falcon_alibi": ("falcon", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=256,
                                    alibi=True, new_decoder_architecture=False, multi_query=False,
                                    parallel_attn=False, num_kv_heads=4, hidden_dropout=0.0,
                                    attention_dropout=0.0)),
}
SETTINGS = {
    "chosen": [],
    "zero1_accumulate": ["dp=2", "zero=1", "micro-batch=1"],
    "zero2_accumulate": ["dp=2", "zero=2", "micro-batch=1"],
    "tp2_full": ["tp=2", "recompute=full"],
    "tp2_selective": ["tp=2", "recompute=selective", "micro-batch=2"],
    "pp2_interleaved": ["pp=2", "vpp=2", "schedule=interleaved-1f1b", "micro-batch=1"],
    "pp2_zero_bubble": ["pp=2", "schedule=zero-bubble", "micro-batch=1"],
    "zero3_offload": ["dp=2", "zero=3", "offload=both"],
    "cp2": ["cp=2"],
    "ep2": ["dp=2", "ep=2"],
}


def write_config(family: str, folder: Path) -> Path:
    from transformers import AutoConfig

    if family in FAMILIES:
        model_type, fields = FAMILIES[family]
        AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
    else:
        tiny_default_config(family).save_pretrained(folder)
    return folder / "config.json"


def tiny_default_config(model_type: str):
    """transformers' default config of `model_type` at the tiny-copy check's sizes, with every
    dropout 0 (a mask drawn on another rank's share of the tokens is not a wrong gradient); its
    heads at the model's own head size, and its experts kept, where the tiny sizes break the
    config (MLA's rotary and latent dimensions, a rotary_dim, grouped routing), as the tiny-copy
    check does."""
    for keep_structure in (False, True):
        config = _shrunk_default(model_type, keep_structure)
        if keep_structure or _runs(config):
            return config


def _shrunk_default(model_type: str, keep_structure: bool):
    from transformers import AutoConfig

    from autoplan.runtime.pipeline_hf import shrink_config

    config = AutoConfig.for_model(model_type)
    shrink_config(config, keep_structure=keep_structure)
    for name, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name or name.endswith("_drop")):
            setattr(config, name, 0.0)
    return config


def _runs(config) -> bool:
    """Whether the tiny model of `config` runs a forward (built on CPU: a few million values)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.no_grad():
            AutoModelForCausalLM.from_config(config)(input_ids=torch.zeros(1, 8, dtype=torch.long))
    except Exception:
        return False
    return True


def run_job(config: Path, gpus: int, fixes: list[str], folder: Path, steps: int) -> tuple[list, list] | str:
    """(losses, grad norms) of the planned, generated and launched job, or why it did not run."""
    plan = folder / "plan.json"
    fix_args = [arg for fix in ["precision=fp32", *fixes] for arg in ("--fix", fix)]
    autoplan = [sys.executable, "-m", "autoplan"]
    planned = subprocess.run([*autoplan, "plan", f"hf:{config}", "--gpu", "cpu", "--gpus", str(gpus),
                              "--global-batch", str(GLOBAL_BATCH), "--seq-len", str(SEQ_LEN),
                              *fix_args, "-o", str(plan)], capture_output=True, text=True)
    if planned.returncode:
        return "refused at plan time: " + planned.stderr.strip().splitlines()[-1][:160]
    data = json.loads(plan.read_text())
    data["optimizer"].update(lr=LR, warmup_steps=0, grad_clip=0.0)
    plan.write_text(json.dumps(data))
    job = folder / "job"
    subprocess.run([*autoplan, "generate", f"hf:{config}", "--plan", str(plan), "-o", str(job)],
                   capture_output=True, text=True, check=True)
    run = subprocess.run(["bash", "launch.sh", "--steps", str(steps), "--run-dir", "runs"], cwd=job,
                         capture_output=True, text=True)
    if run.returncode:
        return f"job failed (exit {run.returncode}): " + run.stderr.strip()[-300:]
    records = [json.loads(line) for line in (job / "runs" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def largest_relative_gap(values: list[float], reference: list[float]) -> float:
    return max(abs(a / b - 1) for a, b in zip(values, reference))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    failures = 0
    print(f"{'family':<12} {'setting':<18} {'loss gap':>9} {'norm gap':>9}  verdict")
    with tempfile.TemporaryDirectory(prefix="hf_sweep_") as tmp:
        for family in args.families.split(","):
            try:
                config = write_config(family, Path(tmp) / family)
            except Exception as exc:  # transformers refuses the shrunk defaults: nothing to run
                print(f"{family:<12} {'(config)':<18} {'':>9} {'':>9}  not built: {str(exc).splitlines()[-1][:120]}")
                continue
            reference = run_job(config, 1, [], Path(tmp) / family / "reference", args.steps)
            if isinstance(reference, str):
                print(f"{family:<12} {'(one rank)':<18} {'':>9} {'':>9}  {reference}")
                continue
            for setting in args.settings.split(","):
                result = run_job(config, 2, SETTINGS[setting], Path(tmp) / family / setting, args.steps)
                if isinstance(result, str):  # a plan-time refusal is fine; a failed job is not
                    failures += result.startswith("job failed")
                    print(f"{family:<12} {setting:<18} {'':>9} {'':>9}  {result}")
                    continue
                loss_gap = largest_relative_gap(result[0], reference[0])
                norm_gap = largest_relative_gap(result[1], reference[1])
                ok = loss_gap <= LOSS_TOLERANCE and norm_gap <= NORM_TOLERANCE
                failures += not ok
                print(f"{family:<12} {setting:<18} {loss_gap:9.1e} {norm_gap:9.1e}  {'ok' if ok else 'WRONG'}",
                      flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
