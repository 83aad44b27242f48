"""Mechanisms that depend on how a runtime schedules work: host-bound MoE layers, the host
launch floor, TP/GEMM overlap, DeepSpeed-2021-style ZeRO-3 gathers, and eager op-by-op
memory traffic against torch.compile's fused regions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import Runtime, comm, compute, estimate, host, layer_cost
from autoplan.cost.layers import tp_exposed_s
from autoplan.cost.profile import block_profile
from autoplan.validate.published import (flash_kernel, load_runs, stated_nic_gb_per_s, tp_comm_overlap_options,
                                 validate_run, zero3_flat_gather)

RUNS = Path(__file__).resolve().parents[2] / "cost_models" / "validation" / "published_runs.json"


def test_moe_host_time_counts_router_dispatch_and_local_experts():
    # 32 fixed ops + 6 per local expert, 15 us each; backward issues twice as many
    fwd, bwd, rc = host.moe_host_s(16, "none")
    assert fwd == pytest.approx((32 + 6 * 16) * 15e-6)
    assert bwd == pytest.approx(2 * fwd)
    assert rc == 0.0
    # full recomputation re-runs the forward and its token-count read-back
    assert host.moe_host_s(16, "full")[2] == pytest.approx(fwd)
    # more local experts (smaller EP) -> more host time
    assert host.moe_host_s(4, "none")[0] < fwd


def test_tp_overlap_leaves_one_chunk_exposed_when_gemms_are_long():
    assert tp_exposed_s(8.0, 4, gemm_s=100.0) == pytest.approx(2.0)  # 1 of 4 chunks
    assert tp_exposed_s(8.0, 4, gemm_s=4.0) == pytest.approx(6.0)  # 4 s not hidden + 1 chunk
    assert tp_exposed_s(8.0, 4, gemm_s=0.0) == pytest.approx(8.0)  # never more than the total
    assert tp_exposed_s(8.0, 1, gemm_s=100.0) == 8.0


def test_tp_overlap_runtime_cuts_exposed_tp_comm(make_gpt_graph, h100_cluster):
    graph = make_gpt_graph(layers=4, hidden=2048, heads=16, seq=2048)
    config = ParallelConfig(global_batch=8, seq_len=2048, dp=2, tp=4, micro_batch=1)
    plain = estimate(graph, config, h100_cluster(8))
    overlap = estimate(graph, config, h100_cluster(8), runtime=Runtime(tp_comm_overlap=True))
    assert 0 < overlap.comm_breakdown_s["tp"] < plain.comm_breakdown_s["tp"]
    assert overlap.step_time_s < plain.step_time_s


def test_host_launch_floor_binds_for_a_tiny_block(make_gpt_graph, h100_cluster):
    # a 64-wide block on 16 tokens takes microseconds on the GPU: issuing its kernels bounds it
    graph = make_gpt_graph(layers=2, hidden=64, heads=4, seq=16)
    config = ParallelConfig(global_batch=1, seq_len=16, dp=1, micro_batch=1)
    block = graph.blocks[0]
    cost = layer_cost(block, graph, config, h100_cluster(1))
    kernels = block_profile(graph, block).kernels
    assert cost.fwd_s == pytest.approx(kernels * host.HOST_S_PER_OP)
    # backward: twice the kernels, plus the fp32 gradient accumulation of the block's ~50k
    # parameters (~0.2 us), hence rel 1e-3
    assert cost.bwd_s == pytest.approx(2 * kernels * host.HOST_S_PER_OP, rel=1e-3)
    assert cost.bwd_s >= 2 * kernels * host.HOST_S_PER_OP


def test_flat_zero3_gathers_stream_through_one_nic(make_gpt_graph, h100_cluster):
    graph = make_gpt_graph(layers=4, hidden=1024, heads=16, seq=1024)
    config = ParallelConfig(global_batch=16, seq_len=1024, dp=16, micro_batch=1, zero_stage=3)
    cluster = h100_cluster(16)  # 2 nodes
    block = graph.blocks[0]
    flat = layer_cost(block, graph, config, cluster, runtime=Runtime(zero3_flat_gather=True))
    params = flat.dense_params
    # AG forward + AG backward + RS, 2 B each, (n-1)/n of it through a 50 GB/s CX-7 NIC at 0.97
    one_pass = params * 2 * 15 / 16 / (50e9 * 0.97)
    assert flat.comm_total_s["zero3"] == pytest.approx(3 * one_pass, rel=1e-6)
    # prefetched: the forward gather hides under the forward, gather + scatter under the
    # backward; what is hidden still slows the compute (contention)
    hidden_not = max(0.0, one_pass - flat.fwd_s) + max(0.0, 2 * one_pass - flat.bwd_s)
    assert 0 < hidden_not < 3 * one_pass  # this small block cannot hide all of it
    assert flat.comm_s["zero3"] == pytest.approx(comm.contended_exposed_s(3 * one_pass, hidden_not))
    hier = layer_cost(block, graph, config, cluster)
    assert hier.comm_s.get("zero3", 0.0) < flat.comm_s["zero3"]


def _run(run_id):
    return next(r for r in load_runs(RUNS) if r["id"] == run_id)


def test_runtime_traits_read_from_the_run_records():
    assert tp_comm_overlap_options(_run("megatron_readme_h100_gpt70b_768gpu")) == [True]  # stated
    assert tp_comm_overlap_options(_run("korthikanti22_175b_64gpu_seqpar_selective")) == [False]
    assert tp_comm_overlap_options(_run("nemo2407_gpt3_175b_128gpu_fp8")) == [False, True]  # unstated
    assert tp_comm_overlap_options(_run("mpt_70b_h100_80gb_64gpu_seq2048_gbs2048")) == [False]  # tp 1
    assert zero3_flat_gather(_run("narayanan21_t2_zero3_174.6b_384gpu"))
    assert not zero3_flat_gather(_run("mpt_70b_h100_80gb_64gpu_seq2048_gbs2048"))  # FSDP, not arXiv
    assert not zero3_flat_gather(_run("narayanan21_t2_ptdp_174.6b_384gpu"))  # ZeRO-1 rows
    assert flash_kernel(_run("mpt_7b_h100_80gb_8gpu_seq2048_gbs48")) == "triton"  # llm-foundry
    assert flash_kernel(_run("megatron_readme_h100_gpt70b_768gpu")) == "flash2"
    # the NIC rate per GPU where the interconnect text states it: 4 x 100 Gb/s Omni-Path per
    # 8-GPU node, 8 x 200 Gb/s HDR per node (Selene); nothing stated: the GPU's default
    assert stated_nic_gb_per_s(_run("bloom176b_384gpu_tr11"), 8) == 6.25
    assert stated_nic_gb_per_s(_run("narayanan21_t1_gpt1.7b_32gpu"), 8) == 25.0
    assert stated_nic_gb_per_s(_run("mbridge_2511_dgx_h100_llama3_70b_64gpu_fp8cs"), 8) is None


def test_triton_flash_kernel_slows_attention_only(make_gpt_graph, h100_cluster):
    """The 2022 Triton FlashAttention kernel: forward 1.4x, backward 2x FlashAttention-2's time
    (Dao 2023 §4.1); GEMMs and memory traffic are the same kernels either way."""
    graph = make_gpt_graph(layers=2, hidden=1024, heads=16, seq=8192)
    config = ParallelConfig(global_batch=1, seq_len=8192, dp=1, micro_batch=1)
    block = graph.blocks[0]
    fa2 = layer_cost(block, graph, config, h100_cluster(1))
    triton = layer_cost(block, graph, config, h100_cluster(1), runtime=Runtime(flash_kernel="triton"))
    from autoplan.cost.layers import compute_times
    attention_fwd = compute_times(block, graph, config, h100_cluster(1).gpu).attention_fwd_s
    assert attention_fwd > 0
    assert triton.fwd_s - fa2.fwd_s == pytest.approx(0.4 * attention_fwd, rel=1e-9)
    assert triton.bwd_s - fa2.bwd_s == pytest.approx(
        compute.BACKWARD_ATTENTION_FACTOR * attention_fwd * (2.0 - 1.0), rel=1e-9)


def test_validation_names_the_attention_kernel_it_assumed():
    result = validate_run(_run("mpt_7b_h100_80gb_8gpu_seq8192_gbs128"))
    assert "triton" in result.assumed["attention"]


def test_zero2_reduce_scatters_every_microbatch_outside_a_pipeline(make_gpt_graph, h100_cluster):
    """FSDP2 ZeRO-2 reduce-scatters each micro-batch's gradients (the runtime keeps them
    sharded); the step end then only gathers the weights. ZeRO-1 reduces once per step."""
    graph = make_gpt_graph(layers=4, hidden=1024, heads=16, seq=1024)
    cluster = h100_cluster(16)  # 2 nodes: the scatter crosses the NICs
    block = graph.blocks[0]
    base = dict(global_batch=64, seq_len=1024, dp=16, micro_batch=1)
    z2 = layer_cost(block, graph, ParallelConfig(**base, zero_stage=2), cluster)
    z1 = layer_cost(block, graph, ParallelConfig(**base, zero_stage=1), cluster)
    assert z2.comm_total_s["zero2"] > 0 and "zero2" not in z1.comm_total_s
    four = estimate(graph, ParallelConfig(**base, zero_stage=2), cluster)
    one = estimate(graph, ParallelConfig(**{**base, "global_batch": 16}, zero_stage=2), cluster)
    # per-micro-batch exposure: 4 micro-batches expose 4x one micro-batch's scatter
    assert four.comm_breakdown_s["zero2"] == pytest.approx(4 * one.comm_breakdown_s["zero2"], rel=1e-9)


def test_pipelined_fsdp_holds_unsharded_fp32_gradients(make_gpt_graph, h100_cluster):
    """torch.distributed.pipelining turns FSDP's gradient sync off for every backward and
    reduces after the last: a ZeRO-2/3 stage accumulates unsharded fp32 gradients, so it
    needs more gradient memory than ZeRO-1, and ZeRO-3 keeps its weights."""
    graph = make_gpt_graph(layers=4, hidden=1024, heads=16, seq=1024)
    cluster = h100_cluster(16)
    block = graph.blocks[0]
    base = dict(global_batch=64, seq_len=1024, dp=8, pp=2, micro_batch=1)
    z1, z2, z3 = (layer_cost(block, graph, ParallelConfig(**base, zero_stage=z), cluster) for z in (1, 2, 3))
    params = z2.dense_params
    # unsharded fp32 gradients (besides the sharded ones), at least ZeRO-1's fp32 gradients
    # (autoplan's runtime autocasts from fp32 module weights below ZeRO-2)
    assert z1.grad_bytes == pytest.approx(params * 4)
    assert z2.grad_bytes >= params * 4 and z3.grad_bytes >= params * 4
    # every block's gathered 16-bit weights, besides the fp32 master shards FSDP2 keeps
    assert z3.weight_bytes == pytest.approx(params * 2 + params * 4 / 8)
    # one micro-batch per step: the schedule still reduces only after the last backward
    # (stage.py backward_maybe_with_nosync turns the sync off for every FSDP backward)
    single = dict(base, global_batch=8)
    z2_single = layer_cost(block, graph, ParallelConfig(**single, zero_stage=2), cluster)
    assert z2_single.grad_bytes == pytest.approx(z2.grad_bytes)
    z2_no_pipeline = layer_cost(block, graph, ParallelConfig(**dict(single, pp=1), zero_stage=2), cluster)
    assert z2_no_pipeline.grad_bytes == pytest.approx(params * 4 / 8)  # fp32 gradient shards


def test_per_op_adamw_moves_its_extra_bytes_through_hbm(make_gpt_graph, h100_cluster):
    # Composer's DecoupledAdamW issues a kernel per tensor op: 80 B per parameter, not 28
    from autoplan.cost import hw
    from autoplan.cost.step import adam_update_bytes_per_param

    assert adam_update_bytes_per_param("bf16") == 28 == adam_update_bytes_per_param("fp32")
    assert adam_update_bytes_per_param("bf16", "per-op") == 80
    graph = make_gpt_graph(layers=4, hidden=2048, heads=16, seq=2048)
    config = ParallelConfig(global_batch=8, seq_len=2048, dp=8, micro_batch=1, zero_stage=3)
    cluster = h100_cluster(8)
    fused = estimate(graph, config, cluster, runtime=Runtime(optimizer_kernels="fused"))
    per_op = estimate(graph, config, cluster)  # autoplan's runtime: torch's foreach AdamW
    params_per_rank = graph.parameters / 8
    extra_s = params_per_rank * (80 - 28) / hw.hbm_bytes_per_s(cluster.gpu)
    # only the optimizer step differs; rel 1e-6 covers float summation order
    assert per_op.step_time_s - fused.step_time_s == pytest.approx(extra_s, rel=1e-6)


def test_megatron_loss_traffic_counts_every_pass_over_the_fp32_logits():
    # VocabParallelCrossEntropy forward: cast (2 read + 4 written), max (4), in-place subtract,
    # exp and div (8 each), sum (4); backward: in-place mul (8), cast back to 16 bits (4 + 2)
    assert compute.LOSS_FWD_BYTES_PER_LOGIT == 38
    assert compute.LOSS_BWD_BYTES_PER_LOGIT == 14


def test_fsdp2_copies_gathers_out_and_gradients_in_on_the_compute_stream(make_gpt_graph, h100_cluster):
    # ZeRO-3: gathered before forward and before backward; each copy-out reads and writes the
    # block's 16-bit parameters once. Each micro-batch's reduce-scatter first copies the 16-bit
    # gradients into its fp32 send buffer (read 2 B, write 4 B a parameter). FSDP1
    # (fsdp_buffer_copies=False) gathers into the parameter and scatters its flat gradient.
    from autoplan.cost import hw

    graph = make_gpt_graph(layers=4, hidden=2048, heads=16, seq=2048)
    config = ParallelConfig(global_batch=8, seq_len=2048, dp=8, micro_batch=1, zero_stage=3)
    cluster = h100_cluster(8)
    block = graph.blocks[0]
    fsdp2 = layer_cost(block, graph, config, cluster)
    fsdp1 = layer_cost(block, graph, config, cluster, runtime=Runtime(fsdp_buffer_copies=False))
    bandwidth = hw.hbm_bytes_per_s(cluster.gpu)
    copy_out_s = block.parameters * 2 * 2 / bandwidth
    copy_in_s = block.parameters * (2 + 4) / bandwidth
    assert fsdp2.fwd_s - fsdp1.fwd_s == pytest.approx(copy_out_s, rel=1e-9)
    assert fsdp2.bwd_s - fsdp1.bwd_s == pytest.approx(copy_out_s + copy_in_s, rel=1e-9)
    zero2 = layer_cost(block, graph, dataclasses.replace(config, zero_stage=2), cluster)
    zero2_fsdp1 = layer_cost(block, graph, dataclasses.replace(config, zero_stage=2), cluster,
                             runtime=Runtime(fsdp_buffer_copies=False))
    assert zero2.fwd_s - zero2_fsdp1.fwd_s == pytest.approx(copy_out_s, rel=1e-9)
    # not resharded after forward: no second gather, but the gradients still go through the buffer
    assert zero2.bwd_s - zero2_fsdp1.bwd_s == pytest.approx(copy_in_s, rel=1e-9)
    # a pipeline accumulates unsharded gradients and reduces once a step: no per-micro-batch copy
    piped = dataclasses.replace(config, dp=4, pp=2)
    assert layer_cost(block, graph, piped, cluster).bwd_s == pytest.approx(
        layer_cost(block, graph, piped, cluster, runtime=Runtime(fsdp_buffer_copies=False)).bwd_s, rel=1e-12)


def test_ring_attention_time_follows_what_each_runtime_sends(make_gpt_graph, h100_cluster):
    from autoplan.cost import volume
    from autoplan.cost.layers import cp_comm_s, fabric_and_groups

    graph = make_gpt_graph(layers=4, hidden=2048, heads=16, seq=8192)
    config = ParallelConfig(global_batch=8, seq_len=8192, dp=2, cp=4, micro_batch=1)
    block = graph.blocks[0]
    fabric, groups = fabric_and_groups(config, h100_cluster(8))
    step = comm.p2p_time_s(volume.cp_hop_bytes(graph, block, config), False, fabric)
    fp32_step = comm.p2p_time_s(volume.cp_hop_bytes(graph, block, config, 4), False, fabric)
    # Transformer Engine (Megatron): 3 x (cp - 1) 16-bit K/V-sized steps
    megatron = Runtime(fp32_module_weights=False, selective_policy="attention_core", cp_grad_ring="kv-dtype")
    assert cp_comm_s(graph, block, config, fabric, groups, 0.0, runtime=megatron)[0] == pytest.approx(9 * step)
    # autoplan's runtime: K/V 2 x (cp - 1) steps, the fp32 gradients cp - 1
    total, exposed = cp_comm_s(graph, block, config, fabric, groups, 0.0)
    assert total == pytest.approx(6 * step + 3 * fp32_step) and exposed == pytest.approx(total)
    # the forward ring again under selective recomputation: exposed, its attention kernels'
    # outputs saved; under full it hides under the recomputed attention as the forward's does
    long_attention = 1.0
    _, none = cp_comm_s(graph, block, config, fabric, groups, long_attention)
    sel_total, selective = cp_comm_s(graph, block, config, fabric, groups, long_attention, "selective")
    full_total, full = cp_comm_s(graph, block, config, fabric, groups, long_attention, "full")
    assert none == 0.0 and sel_total == full_total == pytest.approx(total + 3 * step)
    assert selective == pytest.approx(3 * step) and full == 0.0


LLAMA = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, intermediate_size=704, vocab_size=512, max_position_embeddings=256)


def test_inductor_reads_and_writes_each_region_of_a_llama_block_once():
    # T tokens, h hidden, kv = K/V width, hd head dim, f FFN width, 2-byte dtype. Regions between
    # the GEMMs and attention: norm (x in, out: 2h), q RoPE (q + cos + sin in, q out: 2h + hd),
    # k RoPE (2 kv + hd), residual add + norm (o-proj out and x in, h and norm out: 4h),
    # SiLU x up (gate and up in, product out: 3f), residual add (h and down out in, out: 3h)
    from autoplan.trace.tracer import graph_for_config

    seq = 128
    graph = graph_for_config(LLAMA, 1, seq)
    profile = block_profile(graph, graph.blocks[0], fused=True)
    h, hd, f = 256, 256 // 8, 704
    kv = 2 * hd
    expected = seq * 2 * (11 * h + 2 * kv + 2 * hd + 3 * f)
    assert profile.fused_memory_bytes == expected
    assert profile.fused_memory_bytes < profile.memory_bytes
    # 4 q/k/v/o + 3 MLP GEMMs and attention as extern kernels, 6 fused regions
    assert profile.fused_kernels == 8 + 6 < profile.kernels
    assert profile.rmsnorm_ops == 2 and profile.rmsnorm_elements == 2 * seq * h


def test_eager_rmsnorm_op_by_op_moves_nine_times_a_fused_kernels_bytes():
    # float (2 + 4), pow (8), mean (4), scale (8), type_as (4 + 2), weight mul (2 + 2) = 36 B
    # per element in 16 bits against the fused kernel's 4; 44 against 8 in fp32
    assert compute.decomposed_rmsnorm_bytes_per_element(2) == 36
    assert compute.decomposed_rmsnorm_bytes_per_element(4) == 44
    from autoplan.trace.tracer import graph_for_config

    graph = graph_for_config(LLAMA, 1, 128)
    profile = block_profile(graph, graph.blocks[0], fused=True)
    fused = compute.block_memory_bytes(profile, 2, 2)
    decomposed = compute.block_memory_bytes(profile, 2, 2, rmsnorm_kernel="decomposed")
    assert decomposed - fused == profile.rmsnorm_elements * (36 - 4)
    # compiled, the decomposition fuses with the rest whatever the eager kernel
    assert compute.block_memory_bytes(profile, 2, 2, True, "decomposed") == profile.fused_memory_bytes
    assert compute.block_kernels(profile, rmsnorm_kernel="decomposed") == profile.kernels + 2 * 7


def test_compiled_blocks_cut_memory_time_and_leave_the_head_eager(h100_cluster):
    from autoplan.cost import hw
    from autoplan.trace.tracer import graph_for_config

    wide = dict(LLAMA, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                intermediate_size=2816)
    graph = graph_for_config(wide, 1, 2048)
    config = ParallelConfig(global_batch=4, seq_len=2048, dp=1, micro_batch=4)
    cluster = h100_cluster(1)
    runtime = Runtime(rmsnorm_kernel="decomposed")
    compiled = config.with_(compile=True)
    block, post = graph.blocks[0], graph.post
    e, c = (layer_cost(block, graph, cfg, cluster, runtime=runtime) for cfg in (config, compiled))
    # only the memory-bound ops change (4 sequences on a 1-sequence trace), backward 2x;
    # rel 1e-9 covers float summation order
    profile = block_profile(graph, block, fused=True)
    saved_s = 4 * (compute.block_memory_bytes(profile, 2, 2, rmsnorm_kernel="decomposed")
                   - profile.fused_memory_bytes) / hw.hbm_bytes_per_s(cluster.gpu)
    assert e.fwd_s - c.fwd_s == pytest.approx(saved_s, rel=1e-9)
    assert e.bwd_s - c.bwd_s == pytest.approx(2 * saved_s, rel=1e-9)
    # the final norm, head and loss are outside the compiled blocks: the eager norm still costs
    assert (layer_cost(post, graph, config, cluster, runtime=runtime).fwd_s
            == layer_cost(post, graph, compiled, cluster, runtime=runtime).fwd_s
            > layer_cost(post, graph, config, cluster).fwd_s)


def test_compiled_block_launches_one_kernel_per_fused_region(h100_cluster):
    # a tiny block is bound by the host issuing its kernels: fewer kernels, lower floor
    from autoplan.trace.tracer import graph_for_config

    graph = graph_for_config(LLAMA, 1, 16)
    config = ParallelConfig(global_batch=1, seq_len=16, dp=1, micro_batch=1, compile=True)
    block = graph.blocks[0]
    profile = block_profile(graph, block, fused=True)
    cost = layer_cost(block, graph, config, h100_cluster(1))
    assert cost.fwd_s == pytest.approx(profile.fused_kernels * host.HOST_S_PER_OP)
