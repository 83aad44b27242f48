"""GPUs, clusters and prices: the hardware side of the cost model, read from `cost_models/`.

Data files (format in cost_models/README.md) name their units in their keys (`memory_gib`,
`hbm_bandwidth_gb_per_s`, `peak_tflops`, `*_us`); this module converts them once to SI base
units (bytes, bytes/s, FLOP/s, seconds) so the cost functions never see a GB or a TFLOP.
Every number in a file must have its source in the file's `[sources]` table under the same
dotted key; loading enforces it. Files are found only through `autoplan.paths.cost_models_dir()`.

Layout of ranks (used by `Cluster.nodes_spanned`): rank r lives on node r // gpus_per_node and
in NVLink domain r // scaleup_domain_gpus, the order torchrun gives by default.
"""

from autoplan.hardware.cluster import (Cluster, default_memory_headroom_fraction, load_hardware_file,
                                       make_cluster, resolve_cluster, with_memory_headroom, with_num_gpus,
                                       write_hardware_file)
from autoplan.hardware.gpu import GPU, Efficiency, cpu_adam_params_per_s_per_core, list_gpus, load_gpu
from autoplan.hardware.prices import PriceEntry, Prices, load_prices, parse_price_options
from autoplan.hardware.units import GB, GIB, PRECISIONS, REQUIRED_PRECISIONS, TFLOPS, TOPOLOGIES, US

__all__ = [
    "GB", "GIB", "PRECISIONS", "REQUIRED_PRECISIONS", "TFLOPS", "TOPOLOGIES", "US",
    "GPU", "Efficiency", "cpu_adam_params_per_s_per_core", "list_gpus", "load_gpu",
    "Cluster", "default_memory_headroom_fraction", "load_hardware_file", "make_cluster", "resolve_cluster",
    "with_memory_headroom", "with_num_gpus", "write_hardware_file",
    "PriceEntry", "Prices", "load_prices", "parse_price_options",
]
