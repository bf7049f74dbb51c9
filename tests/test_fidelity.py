"""benchmarks/fidelity.py's inputs and its account of the rows it misses (issue 47): the
A100's NVLink as NCCL reaches it, and what else was checked against its source."""

import dataclasses
import math

import pytest

from cost_models import catalog
from cost_models.cluster import load_cluster
from cost_models.comm import Collective, CommGroup, collective_over, collective_time

GB = 1e9


def test_the_a100s_nvlink_is_the_rate_nccl_reaches_on_it():
    """NVLink 3 is priced at NCCL's bus bandwidth on an A100 (~230 GB/s, NCCL's developer
    in nccl-tests issue 149), not the 300 GB/s line rate: an all-reduce of 1 GB among a
    DGX A100's 8 GPUs takes 2 (n - 1) / n of it over 230 GB/s, plus 2 (n - 1) steps."""
    nvlink = catalog.link("nvlink3")
    assert nvlink.bandwidth == 230 * GB
    assert "nccl-tests issue 149" in catalog.load_catalog().link_sources["nvlink3"]
    for device in ("A100-80G-SXM", "A100-40G-SXM"):
        assert catalog.device(device).intra_link == nvlink
    cluster = load_cluster("1x8xA100-80G-SXM")
    group = CommGroup(((cluster.nodes[0].name, 8),))
    assert collective_time(Collective.ALL_REDUCE, 1 * GB, group, cluster) == pytest.approx(
        2 * 7 / 8 * GB / (230 * GB) + 2 * 7 * 10.8e-6)
    # the H100's NVLink keeps its line rate: NCCL's all-reduce beats it (NVLink SHARP)
    assert catalog.link("nvlink4").bandwidth == 450 * GB


def _priced(fidelity, name: str, error: float):
    row = next(row for row in fidelity.ROWS if row.name == name)
    return fidelity.Priced(row=row, seconds=row.seconds * (1 + error), memory=0.0, fits=True,
                           mfu=0.0, pp_comm=0.0, dp_comm=0.0)


def test_missed_rows_say_what_else_was_checked_and_why_none_of_it_is_used():
    """A tensor-parallel collective moves a micro-batch's hidden states in fp16 (b s h 2
    bytes); the account names the NVLink rate priced, the sizes the rows move, the
    recompute Megatron-LM skips and its 2021 schedule, and says rows predicted too fast
    would be further off without the head's recompute."""
    from benchmarks import fidelity

    rows = {row.name: row for row in fidelity.ROWS}
    assert fidelity.tp_message_bytes(rows["76B (2021)"]) == 2048 * 2 * 10240 * 2
    assert fidelity.tp_message_bytes(rows["175B full"]) == 2048 * 1 * 12288 * 2
    priced = [_priced(fidelity, "1.7B (2021)", 0.0), _priced(fidelity, "76B (2021)", -0.12),
              _priced(fidelity, "175B full", 0.02)]
    text = fidelity.also_checked(priced, too_fast=True)
    assert "priced at 230 GB/s" in text and "nccl-tests issue 149" in text
    assert "collectives move 50-84 MB each" in text  # 175B's and 76B's; 1.7B has no tp
    assert "_checkpointed_forward" in text and "apply_recompute" in text
    assert "the missed ones further off" in text
    assert "further off" not in fidelity.also_checked(priced, too_fast=False)
    # the account comes with the table of missed rows, and only with it
    assert text in fidelity.checked_causes(priced)
    assert fidelity.checked_causes([_priced(fidelity, "76B (2021)", -0.05)]) == ""


# NCCL's all-reduce on one 8 x A100 NVLink node, as published (stas00/ml-engineering
# network/README.md, "Real network throughput": all_reduce_perf -b 32k -e 16G -f 2 -g 8):
# bytes and microseconds, its sizes from 1 MB to 1 GB
NCCL_ALL_REDUCE_ON_A100 = ((1048576, 101.9), (2097152, 101.4), (4194304, 101.5),
                           (8388608, 133.5), (16777216, 276.6), (33554432, 424.0),
                           (67108864, 684.6), (134217728, 1327.6), (268435456, 2420.6),
                           (536870912, 4218.4), (1073741824, 8203.9))


def test_the_a100s_nvlink_latency_is_fitted_to_nccls_all_reduce_timed_size_by_size():
    """NVLink 3's latency is the least-squares alpha of the ring all-reduce's time,
    2 (n - 1) / n S / 230 GB/s + 2 (n - 1) alpha, over NCCL's published times from 1 MB to
    1 GB (not the 2 us estimate), so a 64 MB all-reduce among a DGX A100's 8 GPUs is
    priced near the 684.6 us NCCL took (at 230 GB/s and 2 us it was 539 us, 21% fast)."""
    nvlink = catalog.link("nvlink3")
    spread = [seconds * 1e-6 - 2 * 7 / 8 * size / nvlink.bandwidth
              for size, seconds in NCCL_ALL_REDUCE_ON_A100]
    assert nvlink.latency == pytest.approx(sum(spread) / len(spread) / (2 * 7), abs=0.05e-6)
    assert nvlink.latency == pytest.approx(10.8e-6)
    assert "stas00/ml-engineering" in catalog.load_catalog().link_sources["nvlink3"]
    cluster = load_cluster("1x8xA100-80G-SXM")
    group = CommGroup(((cluster.nodes[0].name, 8),))
    size, measured = NCCL_ALL_REDUCE_ON_A100[6]
    line = dataclasses.replace(nvlink, bus_rates=())  # the alpha-beta line alone
    fitted = collective_over(Collective.ALL_REDUCE, size, group, line, None)
    assert fitted == pytest.approx(2 * 7 / 8 * size / (230 * GB) + 2 * 7 * 10.8e-6)
    assert fitted == pytest.approx(measured * 1e-6, rel=0.05)
    # where NCCL was slower than the line, the measured bus bandwidth prices it
    priced = collective_time(Collective.ALL_REDUCE, size, group, cluster)
    assert priced == pytest.approx(measured * 1e-6, rel=2e-4)
    # the account of the missed rows says what their sizes are priced at
    from benchmarks import fidelity

    text = fidelity.also_checked([_priced(fidelity, "76B (2021)", -0.12),
                                  _priced(fidelity, "175B full", 0.02)], too_fast=True)
    assert "with a latency of 10.8 us a step" in text and "stas00/ml-engineering" in text
    rate = fidelity.node_bus_rate(2048 * 2 * 10240 * 2, cluster)  # 76B's 84 MB
    assert rate == pytest.approx(171.54 * GB * (176.92 / 171.54) ** math.log2(80 / 64))
    assert f"priced at {fidelity.node_bus_rate(2048 * 12288 * 2, cluster) / GB:.0f}-" in text


def test_the_fidelity_section_sets_nvlinks_price_beside_nccls_measurement():
    """Size by size, NCCL's time (from the catalog's bus_rates), the alpha-beta line alone
    and the price: the line where NCCL beat it, the measurement where NCCL was slower."""
    from benchmarks import fidelity

    text = fidelity.nvlink_against_nccl(load_cluster("1x8xA100-80G-SXM"))
    assert "| 64 MiB | 171.54 GB/s | 684.6 us | 661.8 us (-3.3%) | 684.6 us (+0.0%) |" in text
    assert "| 1 MiB | 18.00 GB/s | 101.9 us | 159.2 us (+56.1%) | 159.2 us (+56.1%) |" in text
    assert text.count("\n| ") == 1 + 15  # the header, 1 MB to 16 GB
