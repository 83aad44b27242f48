"""Hardware data (cost_models/gpus, clusters, prices) and autoplan.hardware.

Spot checks pin the transcription of /work/shared/reference/hardware.md: each expected value is
written literally with the line of the reference it comes from, so a typo in a data file fails here.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from autoplan.cli import cli
from autoplan.errors import UserError
from autoplan.hardware import (
    PRECISIONS, list_gpus, load_gpu, load_hardware_file, load_prices, make_cluster,
    parse_price_options, write_hardware_file,
)
from autoplan.paths import cost_models_dir

DATA = cost_models_dir()
GPU_FILES = sorted((DATA / "gpus").glob("*.toml"))
CLUSTER_FILES = sorted((DATA / "clusters").glob("*.toml"))
PRICE_FILES = sorted((DATA / "prices").glob("*.toml"))
REQUIRED_GPU_KEYS = (
    "key", "name", "aliases", "memory_gib", "hbm_bandwidth_gb_per_s", "peak_tflops",
    "intra_node_topology", "intra_node_bandwidth_gb_per_s", "intra_node_latency_us",
    "collective_base_latency_us", "gpus_per_node", "nic_bandwidth_gb_per_s", "inter_node_latency_us",
    "scaleup_domain_gpus", "efficiency", "sources",
)
REQUIRED_EFFICIENCY_KEYS = (
    "matmul_gflop", "matmul_fraction_16bit", "matmul_min_dim", "matmul_min_dim_factor_16bit",
    "intra_node_busbw_fraction", "intra_node_allreduce_busbw_fraction", "nvls_min_gpus",
    "inter_node_busbw_fraction", "inter_node_alltoall_busbw_fraction", "hbm_fraction",
)
# The list: every gpu_key of published_runs.json plus v100, h100-pcie, mi300x, l40s and cpu.
REQUIRED_GPUS = (
    "a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm-80gb", "h100-sxm-96gb", "h100-96gb-500w",
    "h800", "h200-sxm-141gb", "b200", "gb200", "gb300", "v100-sxm2-32gb", "h100-pcie-80gb", "mi300x", "l40s",
    "cpu",
)


def _read(path: Path) -> dict:
    with open(path, "rb") as handle:
        return tomllib.load(handle)


def _numbers(table: dict, prefix: str = "") -> list[str]:
    """Dotted keys of every number or list of numbers, written independently of the loader's walker."""
    found = []
    for key, value in table.items():
        if key == "sources":
            continue
        if isinstance(value, dict):
            found += _numbers(value, f"{prefix}{key}.")
        elif isinstance(value, bool) or isinstance(value, str):
            continue
        elif isinstance(value, (int, float)) or (isinstance(value, list) and value
                                                   and isinstance(value[0], (int, float))):
            found.append(prefix + key)
    return found


# ---------------------------------------------------------------- data files

def test_every_required_gpu_has_a_file() -> None:
    assert {p.stem for p in GPU_FILES} >= set(REQUIRED_GPUS)


@pytest.mark.parametrize("path", GPU_FILES, ids=lambda p: p.stem)
def test_gpu_file_has_every_required_key(path: Path) -> None:
    table = _read(path)
    assert [k for k in REQUIRED_GPU_KEYS if k not in table] == []
    assert [k for k in REQUIRED_EFFICIENCY_KEYS if k not in table["efficiency"]] == []
    assert {"fp32", "fp16"} <= set(table["peak_tflops"]) <= set(PRECISIONS)
    assert table["key"] == path.stem
    if "fp8" in table["peak_tflops"]:
        assert "matmul_fraction_fp8" in table["efficiency"]


@pytest.mark.parametrize("path", GPU_FILES + CLUSTER_FILES, ids=lambda p: p.stem)
def test_every_number_has_a_source(path: Path) -> None:
    table = _read(path)
    sources = table.get("sources", {})
    missing = [k for k in _numbers({k: v for k, v in table.items() if k != "gpu"}) if not str(sources.get(k, "")).strip()]
    assert missing == [], f"{path.name}: numbers without a [sources] entry: {missing}"


@pytest.mark.parametrize("path", PRICE_FILES, ids=lambda p: p.stem)
def test_every_price_has_date_and_source(path: Path) -> None:
    prices = _read(path)["prices"]
    assert prices, path
    for key, entry in prices.items():
        assert entry["usd_per_gpu_hour"] > 0 and entry["date"].strip() and entry["source"].strip(), key


def test_loader_refuses_a_number_without_source(tmp_path: Path) -> None:
    text = (DATA / "gpus" / "h100-sxm-80gb.toml").read_text()
    lines = [line for line in text.splitlines() if not line.startswith('"peak_tflops.fp8"')]
    bad = tmp_path / "h100.toml"
    bad.write_text("\n".join(lines))
    with pytest.raises(UserError, match=r"peak_tflops\.fp8.*no source"):
        load_hardware_file(bad)


# ---------------------------------------------------------------- transcription spot checks

@pytest.mark.parametrize("key, precision, tflops", [
    ("h100-sxm-80gb", "bf16", 989),       # hardware.md line 28: H100 SXM5 BF16 989 (1979 sparse)
    ("h100-sxm-80gb", "fp8", 1979),       # hardware.md line 28: FP8 1979 (3958 sparse)
    ("h100-sxm-80gb", "tf32", 494.5),     # hardware.md line 28: TF32 494.5
    ("a100-sxm4-80gb", "bf16", 312),      # hardware.md line 26: A100 SXM4 80GB BF16 312
    ("a100-sxm4-40gb", "fp32", 19.5),     # hardware.md line 25: A100 FP32 19.5
    ("h200-sxm-141gb", "bf16", 989),      # hardware.md line 30: H200 same as H100
    ("b200", "fp8", 4500),                # hardware.md line 31: B200 FP8 4500 (9000 sparse)
    ("gb200", "bf16", 2500),              # hardware.md line 32: GB200 per GPU BF16 2500
    ("mi300x", "bf16", 1307.4),           # hardware.md line 36: MI300X 1307.4
    ("l40s", "fp8", 733),                 # hardware.md line 33: L40S FP8 733 (1466 sparse)
    ("h100-pcie-80gb", "bf16", 756),      # hardware.md line 29: H100 PCIe 756
    ("v100-sxm2-32gb", "fp16", 125),      # hardware.md line 24: V100 125 FP16 tensor
])
def test_dense_peaks_match_reference(key: str, precision: str, tflops: float) -> None:
    assert load_gpu(key).peak_flops(precision) == pytest.approx(tflops * 1e12, rel=1e-9)


def test_memory_and_links_match_reference() -> None:
    h200 = load_gpu("h200")
    assert h200.memory_bytes == 141 * 2**30           # hardware.md line 30: 141 GB (GiB, README)
    assert h200.hbm_bandwidth_bytes_per_s == 4.8e12   # line 30: 4.8 TB/s
    h100 = load_gpu("h100")
    assert h100.intra_node_bandwidth_bytes_per_s == 450e9  # line 50: NVLink 4, 450 uni / 900 bidi
    assert h100.nic_bandwidth_bytes_per_s == 50e9          # line 50: DGX H100 400 GB/s per node = 50 per GPU
    assert load_gpu("a100").intra_node_bandwidth_bytes_per_s == 300e9  # line 48: 300 uni
    assert load_gpu("b200").memory_bytes == 180 * 2**30    # line 31: 180 usable (1,440 per 8)
    gb200 = load_gpu("gb200")
    assert (gb200.scaleup_domain_gpus, gb200.gpus_per_node) == (72, 4)  # line 54: NVL72, 4 per tray
    assert load_gpu("a100").efficiency.intra_node_busbw_fraction == pytest.approx(231.58 / 300, abs=0.005)  # line 95


def test_missing_precisions_raise() -> None:
    for name in ("a100", "a100-sxm4-40gb", "v100"):
        with pytest.raises(UserError, match="no fp8"):
            load_gpu(name).peak_flops("fp8")
    with pytest.raises(UserError, match="no bf16"):  # hardware.md line 24: no BF16 on Volta
        load_gpu("v100").peak_flops("bf16")
    with pytest.raises(UserError, match="Unknown precision"):
        load_gpu("h100").peak_flops("int4")
    assert not load_gpu("v100").supports("tf32") and load_gpu("h100").supports("fp8")


# ---------------------------------------------------------------- names

@pytest.mark.parametrize("alias, key", [
    ("h100", "h100-sxm-80gb"), ("H100", "h100-sxm-80gb"), ("a100", "a100-sxm4-80gb"),
    ("h200", "h200-sxm-141gb"), ("B200", "b200"), ("mi300x", "mi300x"), ("v100", "v100-sxm2-32gb"),
    ("l40s", "l40s"), ("h800", "h800"), ("gb200", "gb200"), ("GB300", "gb300"),
    (" A100-SXM4-40GB ", "a100-sxm4-40gb"), ("cpu", "cpu"),
])
def test_aliases_resolve(alias: str, key: str) -> None:
    assert load_gpu(alias).key == key


def test_aliases_are_unique() -> None:
    names = [n for g in list_gpus() for n in (g.key, *g.aliases)]
    assert len(names) == len(set(names))


def test_unknown_gpu_lists_known_names() -> None:
    with pytest.raises(UserError) as info:
        load_gpu("h9000")
    message = str(info.value)
    assert "h9000" in message and "h100-sxm-80gb" in message and "a100" in message and "--hardware" in message


# ---------------------------------------------------------------- efficiency

def test_matmul_efficiency_curve() -> None:
    a100 = load_gpu("a100")
    big, cube_1024 = 2 * 16384**3, 2 * 1024**3
    # Plateau = the fixed-shape A100 cuBLASLt 16384^3 measurement, 256.5/312 = 0.822 ([AZ-A100],
    # hardware.md B.4), not the best-of-search MAMF 86.9%; 1024^3 keeps the ratio 119.4/256.5.
    assert a100.matmul_efficiency(big, 16384) == pytest.approx(256.5 / 312, abs=1e-3)
    assert a100.matmul_efficiency(cube_1024, 1024) == pytest.approx(119.4 / 312, abs=2e-3)
    # Skinny GEMM 802816x192x768 measured 157.8/312 = 0.506 (line 152, [AZ-A100]): reproduced.
    assert a100.matmul_efficiency(2 * 802816 * 192 * 768, 192) == pytest.approx(157.8 / 312, abs=2e-3)
    h100 = load_gpu("h100")
    # H100 fp8 16384^3 measured 1377.3 of 1979 TFLOP/s (line 151, [AZ-*]).
    assert h100.matmul_efficiency(big, 16384, "fp8") == pytest.approx(1377.3 / 1979, abs=1e-3)
    sizes = [1e6, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14]
    values = [h100.matmul_efficiency(f, 8192) for f in sizes]
    assert values == sorted(values) and values[0] >= 0.02 and values[-1] < 794.5 / 989  # under MAMF
    with pytest.raises(UserError):
        a100.matmul_efficiency(big, 16384, "fp8")


def test_mesh_topology_pair_gets_one_link() -> None:
    mi300x = load_gpu("mi300x")  # hardware.md line 58/105: 64 GB/s per peer link, 448 all-to-all
    assert mi300x.intra_node_group_bandwidth_bytes_per_s(2) == pytest.approx(64e9)
    assert mi300x.intra_node_group_bandwidth_bytes_per_s(8) == pytest.approx(448e9)
    assert load_gpu("h100").intra_node_group_bandwidth_bytes_per_s(2) == 450e9  # NVSwitch: full link


# ---------------------------------------------------------------- clusters

def test_make_cluster_nodes_and_groups() -> None:
    cluster = make_cluster(load_gpu("h100"), 64)
    assert (cluster.num_nodes, cluster.gpus_per_node, cluster.scaleup_domain_gpus) == (8, 8, 8)
    assert cluster.nodes_spanned(8, 1) == 1        # TP=8 inside a node
    assert cluster.nodes_spanned(4, 2) == 1        # ranks 0,2,4,6
    assert cluster.nodes_spanned(8, 2) == 2        # ranks 0..14
    assert cluster.nodes_spanned(8, 8) == 8        # DP across nodes
    assert cluster.nodes_spanned(3, 3) == 1        # ranks 0,3,6
    assert cluster.nodes_spanned(4, 3) == 2        # ranks 0,3,6,9
    assert not cluster.crosses_nodes(8) and cluster.crosses_nodes(16)
    with pytest.raises(ValueError):
        cluster.nodes_spanned(65)


def test_nvl72_domain_spans_trays() -> None:
    cluster = make_cluster(load_gpu("gb200"), 256)
    assert cluster.num_nodes == 64 and cluster.nodes_spanned(8) == 2 and cluster.domains_spanned(8) == 1
    assert cluster.domains_spanned(2, 64) == 1  # ranks 0 and 64: both in rack 0 (ranks 0..71)
    assert cluster.domains_spanned(2, 72) == 2  # ranks 0 and 72: next rack, over the NIC


def test_make_cluster_validation_and_overrides() -> None:
    h100 = load_gpu("h100")
    assert make_cluster(h100, 4).num_nodes == 1  # partial single node allowed
    for bad in (0, -8):
        with pytest.raises(UserError, match="positive"):
            make_cluster(h100, bad)
    with pytest.raises(UserError, match="whole nodes"):
        make_cluster(h100, 12)
    small = make_cluster(h100, 8, gpus_per_node=4, inter_node_bandwidth_gb_per_s=25)
    assert small.scaleup_domain_gpus == 4 and small.inter_node_bandwidth_bytes_per_s == 25e9
    assert make_cluster(load_gpu("gb200"), 16, gpus_per_node=8).scaleup_domain_gpus == 72
    with pytest.raises(UserError, match="scale-up domain"):
        make_cluster(load_gpu("gb200"), 10, gpus_per_node=5)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.stem)
def test_cluster_files_load(path: Path) -> None:
    cluster = load_hardware_file(path)
    assert cluster.num_gpus == cluster.num_nodes * cluster.gpus_per_node
    assert cluster.scaleup_domain_gpus % cluster.gpus_per_node == 0


def test_cluster_file_overrides_and_resize() -> None:
    p4d = load_hardware_file(DATA / "clusters" / "aws-p4d.toml")
    assert p4d.gpu.key == "a100-sxm4-40gb" and p4d.inter_node_bandwidth_bytes_per_s == 6.25e9  # line 48
    nvl = load_hardware_file(DATA / "clusters" / "gb200-nvl72.toml").with_num_gpus(144)
    assert (nvl.num_nodes, nvl.scaleup_domain_gpus, nvl.domains_spanned(2, 72)) == (36, 72, 2)


def test_gpu_file_is_a_hardware_file() -> None:
    cluster = load_hardware_file(DATA / "gpus" / "b200.toml")
    assert cluster.gpu == load_gpu("b200") and cluster.num_gpus == 8


@pytest.mark.parametrize("text, key", [
    ('gpu = "h100"\ngpus_per_node = "eight"\n[sources]\n', "gpus_per_node"),
    ('gpu = "h100"\nnic_bandwidth_gb_per_s = 40\n', "nic_bandwidth_gb_per_s"),
    ('gpu = "h100"\nnic_bandwith_gb_per_s = 40\n[sources]\nnic_bandwith_gb_per_s = "x"\n', "nic_bandwith_gb_per_s"),
    ('gpu = "h9000"\n', "h9000"),
    ('gpu = [1, 2\n', "not valid TOML"),
    ('key = "x"\nname = "x"\n[peak_tflops]\nfp32 = 1\n[sources]\n"peak_tflops.fp32" = "s"\n', "intra_node_topology"),
])
def test_malformed_hardware_file_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError, match=key):
        load_hardware_file(path)


def test_missing_hardware_file() -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_hardware_file("/nonexistent/cluster.toml")


# ---------------------------------------------------------------- writing (calibrate)

def test_write_hardware_file_round_trip(tmp_path: Path) -> None:
    measured = load_gpu("h100").with_values(
        {"hbm_bandwidth_gb_per_s": 2901.5, "peak_tflops.bf16": 801.25, "efficiency.hbm_fraction": 1.0},
        source="measured 2026-12-02: test")
    cluster = make_cluster(measured, 16, inter_node_bandwidth_gb_per_s=37.5)
    path = write_hardware_file(cluster, tmp_path / "mine.toml", "2026-12-02", "unit test \"quoted\"")
    back = load_hardware_file(path)
    assert back.gpu == measured
    assert back.gpu.peak_flops("bf16") == 801.25e12 and back.gpu.hbm_bandwidth_bytes_per_s == 2901.5e9
    assert back.gpu.sources["peak_tflops.bf16"] == "measured 2026-12-02: test"
    assert (back.num_gpus, back.inter_node_bandwidth_bytes_per_s) == (16, 37.5e9)
    assert (back.measured_at, back.method) == ("2026-12-02", 'unit test "quoted"')
    assert back.intra_node_latency_s == pytest.approx(cluster.intra_node_latency_s, rel=1e-12)
    # A plain GPU round-trips too, for every catalogue GPU (fp8-less, mesh, cpu included).
    for gpu in list_gpus():
        assert load_hardware_file(write_hardware_file(gpu, tmp_path / f"{gpu.key}.toml", "d", "m")).gpu == gpu


# ---------------------------------------------------------------- prices

def test_prices_defaults_overrides_and_missing() -> None:
    prices = load_prices()
    assert prices.usd_per_gpu_hour("h100") == 3.00   # hardware.md line 192: specialty 2.50-3.50, midpoint
    assert prices.usd_per_gpu_hour("mi300x") == 1.99  # line 197: median 1.99
    assert prices.entry("a100-sxm4-40gb").date == "2026-05-07"
    with pytest.raises(UserError, match=r"--price v100-sxm2-32gb="):
        prices.usd_per_gpu_hour("v100")
    overridden = load_prices({"H100": 2.1, "gb200": 6.0})
    assert overridden.usd_per_gpu_hour("h100-sxm-80gb") == 2.1 and overridden.usd_per_gpu_hour("gb200-nvl72") == 6.0
    assert load_prices(price_list="aws-capacity-blocks-2024").usd_per_gpu_hour("h200") == 5.408  # line 193
    with pytest.raises(UserError, match="positive"):
        load_prices({"h100": -1.0})
    with pytest.raises(UserError, match="Unknown price list"):
        load_prices(price_list="nope")


def test_parse_price_options() -> None:
    assert parse_price_options(["h100=2.5", "GB200 = 6"]) == {"h100": 2.5, "gb200": 6.0}
    for bad in ("h100", "h100=", "=2", "h100=abc", "h100=0", "h100=inf"):
        with pytest.raises(UserError, match="--price"):
            parse_price_options([bad])


# ---------------------------------------------------------------- CLI

def test_gpus_command_json() -> None:
    result = CliRunner().invoke(cli, ["gpus", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["key"]: row for row in json.loads(result.output)["gpus"]}
    assert set(REQUIRED_GPUS) <= set(rows)
    h100 = rows["h100-sxm-80gb"]
    assert h100["peak_tflops"]["bf16"] == 989 and "h100" in h100["aliases"]  # hardware.md line 28
    assert h100["usd_per_gpu_hour"] == 3.0 and h100["price_source"]
    assert "fp8" not in rows["a100-sxm4-80gb"]["peak_tflops"] and rows["gb300"]["usd_per_gpu_hour"] is None
    assert all(math.isfinite(r["memory_gib"]) and r["memory_gib"] > 0 for r in rows.values())


def test_gpus_command_table() -> None:
    result = CliRunner().invoke(cli, ["gpus"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "h100-sxm-80gb" in result.output and "mi300x" in result.output and "--price" in result.output
