"""The device catalog: packaged data, lookups, validation and `planner devices`."""

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from cost_models import catalog
from planner.errors import PlannerError

REQUIRED = ["A100-40G-SXM", "A100-80G-SXM", "A100-40G-PCIE", "A100-80G-PCIE", "H100-SXM",
            "H100-PCIE", "H200", "V100-16G", "V100-32G", "T4", "L4", "A10", "A10G", "RTX3090",
            "RTX4090", "MI250X", "MI300X", "cpu"]
LINKS = ["nvlink2", "nvlink3", "nvlink4", "pcie3", "pcie4", "pcie5", "infinity-fabric-mi250x",
         "infinity-fabric-mi300x", "shm"]


def test_every_required_device_has_positive_sourced_figures():
    assert set(REQUIRED) <= set(catalog.device_names())
    for name in catalog.device_names():
        d = catalog.device(name)
        assert d.name == name and d.vendor
        assert d.memory > 0 and d.memory_bandwidth > 0
        assert d.peak_flops["fp32"] > 0 and all(v > 0 for v in d.peak_flops.values())
        assert set(d.peak_flops) <= {"fp32", "tf32", "bf16", "fp16"}
        assert d.intra_link.bandwidth > 0 and d.intra_link.latency >= 0
        gemm = {key for key in ("compute_units", "gemm_efficiency") if getattr(d, key)}
        assert set(d.sources) == {"peak_flops", "memory_bandwidth", "memory", "intra_link",
                                  *gemm}
        assert all(text.strip() for text in d.sources.values())
        assert d.compute_units is None or d.compute_units >= 1
        assert d.gemm_efficiency is None or 0.5 < d.gemm_efficiency < 1
    assert list(catalog.load_catalog().links) == LINKS


@pytest.mark.parametrize("alias, name", [
    ("a100-80g", "A100-80G-SXM"),
    ("NVIDIA A100-SXM4-80GB", "A100-80G-SXM"),
    ("nvidia a100-sxm4-40gb", "A100-40G-SXM"),
    ("NVIDIA A100-PCIE-40GB", "A100-40G-PCIE"),
    ("NVIDIA A100 80GB PCIe", "A100-80G-PCIE"),
    ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("NVIDIA H100 PCIe", "H100-PCIE"),
    ("NVIDIA H200", "H200"),
    ("Tesla V100-SXM2-16GB", "V100-16G"),
    ("Tesla V100-SXM2-32GB", "V100-32G"),
    ("Tesla T4", "T4"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA GeForce RTX 3090", "RTX3090"),
    ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ("AMD Instinct MI250X", "MI250X"),
    ("AMD Instinct MI300X", "MI300X"),
    ("  h100-sxm ", "H100-SXM"),
])
def test_aliases_and_torch_device_names_resolve(alias, name):
    assert catalog.device(alias).name == name


def test_unknown_names_suggest_close_ones():
    with pytest.raises(PlannerError) as err:
        catalog.device("A100-80G-SMX")
    assert err.value.kind == "unknown-device"
    assert "A100-80G-SXM" in err.value.message and "planner devices" in err.value.remedies[0]
    with pytest.raises(PlannerError) as err:
        catalog.link("nvlink5")
    assert err.value.kind == "unknown-link" and "nvlink4" in err.value.message


def test_links_by_key_or_display_name():
    assert catalog.link("nvlink3").bandwidth == 230e9  # NCCL's rate on 600 GB/s both ways
    assert catalog.link("NVLink 3") is catalog.link("NVLINK3")
    assert catalog.device("A100-80G-SXM").intra_link == catalog.link("nvlink3")
    assert catalog.link("nvlink4").bandwidth == 450e9 and catalog.link("pcie4").bandwidth == 32e9


def test_known_datasheet_values():
    a100 = catalog.device("A100-80G-SXM")
    assert a100.flops("bf16") == 312e12 and a100.flops("tf32") == 156e12
    assert a100.memory_bandwidth == 2.039e12 and a100.memory == 80 * 2**30
    h100 = catalog.device("H100-SXM")
    assert h100.flops("bf16") == pytest.approx(989.4e12)  # dense; 1979 is with sparsity
    assert catalog.device("H200").flops("bf16") == h100.flops("bf16")
    mi250x = catalog.device("MI250X")  # per GCD: half a package
    assert mi250x.memory_bandwidth == 1.6e12 and mi250x.flops("bf16") == 191.5e12
    assert catalog.device("RTX4090").flops("fp16") == pytest.approx(165.2e12)  # fp32 accum.


def test_missing_dtype_falls_back_to_fp32():
    v100 = catalog.device("V100-32G")
    assert "bf16" not in v100.peak_flops and "tf32" not in v100.peak_flops
    assert v100.flops("bf16") == v100.flops("tf32") == v100.flops("fp32") == 15.7e12
    assert v100.flops("fp16") == 125e12


def test_cpu_is_a_marked_placeholder():
    cpu = catalog.device("cpu")
    assert cpu.intra_link == catalog.link("shm")
    assert all("PLACEHOLDER" in text for text in cpu.sources.values())


_GOOD = """\
schema_version: 1
links:
  fast: {name: Fast, bandwidth: 10GB/s, latency: 1us, source: "a test"}
devices:
  X1:
    vendor: test
    aliases: [x-one]
    memory: 8GiB
    memory_bandwidth: 100GB/s
    peak_flops: {fp32: 1TFLOPS, bf16: 4TFLOPS}
    intra_link: fast
    sources: {peak_flops: a, memory_bandwidth: b, memory: c, intra_link: d}
"""


def _load(tmp_path, text):
    path = tmp_path / "devices.yaml"
    path.write_text(text)
    return catalog.load_catalog(path)


def test_loader_reads_a_catalog_file(tmp_path):
    with pytest.raises(PlannerError, match=r"devices.yaml line \d+: not valid YAML"):
        _load(tmp_path, _GOOD.replace("links:", "links: ["))
    cat = _load(tmp_path, _GOOD)
    x1 = cat.device("X-ONE")
    assert (x1.name, x1.memory, x1.flops("bf16")) == ("X1", 8 * 2**30, 4e12)
    assert x1.sources["memory"] == "c" and cat.link("fast").latency == 1e-6


@pytest.mark.parametrize("old, new, field", [
    ("memory: 8GiB", "memory: eight", "devices.X1.memory"),
    ("memory: 8GiB", "memory: 0GiB", "devices.X1.memory"),
    ("bf16: 4TFLOPS", "bf16: fast", "devices.X1.peak_flops.bf16"),
    ("bf16: 4TFLOPS", "int8: 4TFLOPS", "devices.X1.peak_flops.int8"),
    ("fp32: 1TFLOPS, ", "", "devices.X1.peak_flops"),
    ("intra_link: fast", "intra_link: slow", "devices.X1.intra_link"),
    ("    memory_bandwidth: 100GB/s\n", "", "devices.X1"),
    ("memory_bandwidth: 100GB/s", "memory_bandwith: 100GB/s", "devices.X1.memory_bandwith"),
    ("memory: c, ", "", "devices.X1.sources"),
    ("aliases: [x-one]", "aliases: [x1]", "devices.X1.aliases"),
    ("bandwidth: 10GB/s", "bandwidth: 10 parsecs", "links.fast.bandwidth"),
    ('"a test"}', '"a test", bus_rates: {1048576: fast}}', "links.fast.bus_rates.1048576"),
    ('"a test"}', '"a test", bus_rates: {0: 1GB/s}}', "links.fast.bus_rates.0"),
    ('"a test"}', '"a test", bus_rates: {1MiB: 1GB/s, 1048576: 2GB/s}}',
     "links.fast.bus_rates.1048576"),
    ('"a test"}', '"a test", bus_rates: [1GB/s]}', "links.fast.bus_rates"),
])
def test_malformed_entries_name_the_entry_and_field(tmp_path, old, new, field):
    assert old in _GOOD
    with pytest.raises(PlannerError) as err:
        _load(tmp_path, _GOOD.replace(old, new))
    assert err.value.kind == "bad-catalog"
    assert f"{field}:" in err.value.message and str(tmp_path) in err.value.message


def test_a_links_measured_bus_rates_are_read_smallest_first(tmp_path):
    text = _GOOD.replace('"a test"}', '"a test", bus_rates: {2MiB: 8GB/s, 1048576: 5GB/s}}')
    link = _load(tmp_path, text).link("fast")
    assert [(rate.size, rate.bus_bandwidth) for rate in link.bus_rates] == [
        (2**20, 5e9), (2**21, 8e9)]
    assert _load(tmp_path, _GOOD).link("fast").bus_rates == ()


_GEMM = _GOOD.replace("    intra_link: fast\n", "    intra_link: fast\n    compute_units: 100\n"
                      "    gemm_efficiency: 0.8\n").replace(
    "intra_link: d}", "intra_link: d, compute_units: e, gemm_efficiency: f}")


def test_gemm_figures_are_read_with_their_sources(tmp_path):
    x1 = _load(tmp_path, _GEMM).device("X1")
    assert (x1.compute_units, x1.gemm_efficiency) == (100, 0.8)
    assert (x1.sources["compute_units"], x1.sources["gemm_efficiency"]) == ("e", "f")
    assert _load(tmp_path, _GOOD).device("X1").compute_units is None


@pytest.mark.parametrize("old, new, field", [
    ("compute_units: 100", "compute_units: 0", "devices.X1.compute_units"),
    ("compute_units: 100", "compute_units: 12.5", "devices.X1.compute_units"),
    ("gemm_efficiency: 0.8", "gemm_efficiency: 1.5", "devices.X1.gemm_efficiency"),
    ("gemm_efficiency: 0.8", "gemm_efficiency: high", "devices.X1.gemm_efficiency"),
    (", gemm_efficiency: f", "", "devices.X1.sources"),  # a figure needs its source
])
def test_malformed_gemm_figures_name_the_field(tmp_path, old, new, field):
    assert old in _GEMM
    with pytest.raises(PlannerError) as err:
        _load(tmp_path, _GEMM.replace(old, new))
    assert err.value.kind == "bad-catalog" and f"{field}:" in err.value.message


runner = CliRunner()


def test_cli_devices_json_and_table():
    result = runner.invoke(app, ["devices", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert set(REQUIRED) <= set(rows)
    a100 = rows["A100-80G-SXM"]
    assert a100["peak_flops"]["bf16"] == 312e12 and a100["memory_bandwidth"] == 2.039e12
    assert a100["intra_link"] == {"name": "NVLink 3", "bandwidth": 230e9, "latency": 10.8e-6}
    assert "NVIDIA A100-SXM4-80GB" in a100["aliases"]
    assert "datasheet" in a100["sources"]["peak_flops"]
    amd = json.loads(runner.invoke(app, ["devices", "--json", "--vendor", "AMD"]).stdout)
    assert [r["name"] for r in amd] == ["MI250X", "MI300X"]
    table = runner.invoke(app, ["devices", "--vendor", "nvidia", "--sources"])
    assert table.exit_code == 0 and "H100-SXM" in table.stdout and "MI300X" not in table.stdout
    assert "nvlink3" in table.stdout and "Sources" in table.stdout


def test_cli_devices_searches_names_and_aliases_as_the_session_does():
    a100 = json.loads(runner.invoke(app, ["devices", "a100", "--json"]).stdout)
    assert {r["name"] for r in a100} == {"A100-40G-SXM", "A100-80G-SXM", "A100-40G-PCIE",
                                         "A100-80G-PCIE"}
    by_alias = json.loads(runner.invoke(app, ["devices", "A100-SXM4-80GB", "--json"]).stdout)
    assert [r["name"] for r in by_alias] == ["A100-80G-SXM"]
    none = runner.invoke(app, ["devices", "zzz"])
    assert none.exit_code == 1 and "No device type matches 'zzz'" in none.output


def test_cli_devices_unknown_vendor():
    result = runner.invoke(app, ["devices", "--vendor", "intel"])
    assert result.exit_code == 1 and "Unknown vendor 'intel'" in result.output
