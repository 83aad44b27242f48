"""Click options shared by several commands, defined once."""

from __future__ import annotations

import click

model_argument = click.argument("model", metavar="MODEL")
seq_len_option = click.option("--seq-len", type=int, default=None,
                              help="Sequence length in tokens (default: the model's, else 2048).")
image_size_option = click.option(
    "--image-size", type=int, default=None,
    help="Image side in pixels, for models that take images (default: the model's, else 224).")
global_batch_option = click.option("--global-batch", type=int, required=True,
                                   help="Global batch in sequences per optimizer step.")
gpu_option = click.option("--gpu", "gpu", default=None,
                          help="GPU name or alias (see `autoplan gpus`), e.g. h100, a100-sxm4-80gb, cpu.")
hardware_option = click.option("--hardware", type=click.Path(dir_okay=False), default=None,
                               help="A hardware/cluster TOML file (e.g. from `autoplan calibrate`) instead of --gpu.")
gpus_option = click.option("--gpus", type=int, required=True, help="Number of GPUs (ranks).")
gpus_per_node_option = click.option("--gpus-per-node", type=int, default=None,
                                    help="GPUs per node (default: the GPU's typical system).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
inter_node_bandwidth_option = click.option(
    "--inter-node-bandwidth", type=float, default=None, metavar="GB/S",
    help="Scale-out (NIC) bandwidth per GPU, one direction, in GB/s (default: the GPU's typical "
         "system, e.g. 50 = 400 Gb/s per H100).")
memory_headroom_option = click.option(
    "--memory-headroom", type=float, default=0.0, show_default=True, metavar="GIB",
    help="GiB of each GPU's memory a plan leaves free (allocator fragmentation, memory spikes).")
