"""The vocab-parallel embedding computes what DTensor's RowwiseParallel embedding computes.

usage: torchrun --nproc-per-node 2 vocab_embedding_worker.py RESULTS.json
On each rank, for each case (sequence-sharded or replicated output, a padding row on either
rank, a vocabulary that does not split evenly), both styles embed the same token ids and
backpropagate the same output gradient; rank 0 writes {case: [output max abs difference,
weight-gradient max abs difference]}, the differences taken over every rank's shards.
"""

import gc
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from autoplan.runtime.tensor_parallel import VocabParallelEmbedding

CASES = {"seq_sharded": (64, Shard(1), None), "replicated": (64, Replicate(), None),
         "padding_rank0": (64, Shard(1), 3), "padding_rank1": (64, Shard(1), 40),
         "uneven_vocab": (67, Shard(1), None)}


def run(style, vocab: int, padding, ids: torch.Tensor, grad_seed: int, mesh):
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, 16, padding_idx=padding)
    parallelize_module(emb, mesh, style)
    out = emb(ids)
    torch.manual_seed(grad_seed)
    grad = torch.randn(out.shape)
    out.backward(grad)
    return out.detach(), emb.weight.grad.full_tensor()


def main(results_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(1)
    results = {}
    for name, (vocab, layout, padding) in CASES.items():
        ids = torch.randint(0, vocab, (2, 12))
        ids[0, :3] = padding if padding is not None else 0  # the padding row is used
        ids[1, :4] = 5  # a repeated row accumulates
        dist.broadcast(ids, 0)
        # a replicated output gets the same gradient on every rank, a sharded one its own
        seed = 2 + (dist.get_rank() if isinstance(layout, Shard) else 0)
        ref_out, ref_grad = run(RowwiseParallel(input_layouts=Replicate(), output_layouts=layout),
                                vocab, padding, ids, seed, mesh)
        out, grad = run(VocabParallelEmbedding(output_layout=layout), vocab, padding, ids,
                        seed, mesh)
        diff = torch.tensor([(out - ref_out).abs().max().item(),
                             (grad - ref_grad).abs().max().item()])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        results[name] = diff.tolist()
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)
    gc.collect()  # free DTensor cycles before teardown (runtime/loop.py train)
    dist.barrier()  # nobody tears down while a peer still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
