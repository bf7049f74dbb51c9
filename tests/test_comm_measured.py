"""Collectives over a link whose bus bandwidth was measured size by size
(`LinkSpec.bus_rates`, cost_models/comm.py `measured_seconds`): the catalog's NVLink 3
carries NCCL's all-reduce on one 8 x A100 node as published, and is priced at it where
NCCL was slower than the alpha-beta line."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models import catalog
from cost_models.cluster import load_cluster
from cost_models.comm import Collective, CommGroup, collective_over, collective_time
from planner.types import LinkSpec
from planner.types.cluster import BusRate

# all_reduce_perf -b 32k -e 16G -f 2 -g 8 on one 8 x A100 NVLink node, stas00/ml-engineering
# network/README.md, "Real network throughput": bytes, microseconds, busbw (GB/s)
NCCL_ON_A100 = ((1048576, 101.9, 18.00), (2097152, 101.4, 36.18), (4194304, 101.5, 72.33),
                (8388608, 133.5, 109.93), (16777216, 276.6, 106.16),
                (33554432, 424.0, 138.49), (67108864, 684.6, 171.54),
                (134217728, 1327.6, 176.92), (268435456, 2420.6, 194.07),
                (536870912, 4218.4, 222.72), (1073741824, 8203.9, 229.04),
                (2147483648, 16240, 231.41), (4294967296, 32136, 233.88),
                (8589934592, 64074, 234.61), (17179869184, 127997, 234.89))
RINGS = (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER,
         Collective.BROADCAST)


def _node_of_8():
    cluster = load_cluster("1x8xA100-80G-SXM")
    return cluster, CommGroup(((cluster.nodes[0].name, 8),))


def _alpha_beta(kind: Collective, nbytes: float, n: int, link: LinkSpec) -> float:
    """The ring's alpha-beta time, as comm.py priced every link before measured rates."""
    if kind is Collective.BROADCAST:
        return nbytes / link.bandwidth + (n - 1) * link.latency
    terms = 2 if kind is Collective.ALL_REDUCE else 1
    return terms * (n - 1) / n * nbytes / link.bandwidth + terms * (n - 1) * link.latency


def test_nvlink3_carries_nccls_published_bus_bandwidth_from_1_mb_to_16_gb():
    nvlink = catalog.link("nvlink3")
    assert [(rate.size, rate.bus_bandwidth) for rate in nvlink.bus_rates] == [
        (size, busbw * 1e9) for size, _, busbw in NCCL_ON_A100]
    assert nvlink.bandwidth == 230e9  # the large-size rate stays the link's bandwidth
    assert "bus_rates" in catalog.load_catalog().link_sources["nvlink3"]


@pytest.mark.parametrize("row", [5, 6, 7, 8])  # 32, 64, 128 and 256 MB
def test_an_all_reduce_of_a_measured_size_is_priced_at_its_measurement(row):
    """Where NCCL took longer than the alpha-beta line (32-256 MB on NVLink 3: the sizes
    tensor-parallel collectives move), the price is NCCL's time; before, 4-10% less."""
    cluster, group = _node_of_8()
    size, microseconds, _ = NCCL_ON_A100[row]
    priced = collective_time(Collective.ALL_REDUCE, size, group, cluster)
    assert priced == pytest.approx(microseconds * 1e-6, rel=2e-4)  # busbw has 4-5 digits
    assert priced > _alpha_beta(Collective.ALL_REDUCE, size, 8, catalog.link("nvlink3"))


def test_between_measured_sizes_the_bus_bandwidth_follows_a_power_law_of_the_size():
    """76B's tensor-parallel all-reduce, 80 MiB, lies between 64 and 128 MiB: its bus
    bandwidth, 171.54 * (176.92 / 171.54) ** log2(80 / 64) GB/s (and NCCL's latency is in
    it: no alpha is added)."""
    cluster, group = _node_of_8()
    size = 2048 * 2 * 10240 * 2
    busbw = 171.54e9 * (176.92 / 171.54) ** math.log2(size / 2**26)
    assert collective_time(Collective.ALL_REDUCE, size, group, cluster) == pytest.approx(
        2 * 7 / 8 * size / busbw)


def test_where_nccl_beat_the_alpha_beta_line_the_line_stays():
    """Below 1 MB nothing was measured; up to 16 MB and from 512 MB NCCL was faster than
    the fitted line, which the solver's floors take as the least a collective costs."""
    cluster, group = _node_of_8()
    nvlink = catalog.link("nvlink3")
    for size in (4096, 2**20, 2**23, 2**24, 2**29, 2**30, 2**34, 2**36):
        assert collective_time(Collective.ALL_REDUCE, size, group, cluster) == _alpha_beta(
            Collective.ALL_REDUCE, size, 8, nvlink)


@pytest.mark.parametrize("name", ["nvlink4", "pcie4", "infinity-fabric-mi300x", "shm"])
def test_a_link_without_measured_rates_prices_exactly_as_before(name):
    link = catalog.link(name)
    assert link.bus_rates == ()
    for kind in RINGS:
        for n in (2, 3, 8):
            group = CommGroup((("a", n),))
            for size in (1.0, 2**20, 3e8, 2**36):
                assert collective_over(kind, size, group, link, None) == _alpha_beta(
                    kind, size, n, link)
    bare = dataclasses.replace(catalog.link("nvlink3"), bus_rates=())
    assert collective_over(Collective.ALL_REDUCE, 2**27, CommGroup((("a", 8),)), bare,
                           None) == _alpha_beta(Collective.ALL_REDUCE, 2**27, 8, bare)


def test_a_group_keeps_measured_rates_only_where_all_its_links_share_them():
    nvlink = catalog.link("nvlink3")
    assert nvlink.slowest(nvlink, nvlink).bus_rates == nvlink.bus_rates
    mixed = nvlink.slowest(catalog.link("pcie4"))
    assert mixed.bus_rates == () and mixed.bandwidth == catalog.link("pcie4").bandwidth


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(RINGS), n=st.integers(2, 16),
       sizes=st.lists(st.floats(1.0, 2.0**36), min_size=2, max_size=2))
def test_nvlink3s_price_never_falls_as_the_bytes_grow(kind, n, sizes):
    nvlink = catalog.link("nvlink3")
    group = CommGroup((("a", n),))
    small, large = sorted(sizes)
    assert (collective_over(kind, small, group, nvlink, None)
            <= collective_over(kind, large, group, nvlink, None))


@settings(max_examples=200, deadline=None)
@given(rates=st.lists(st.tuples(st.integers(10, 40), st.floats(1e8, 1e12)), min_size=1,
                      max_size=8, unique_by=lambda rate: rate[0]),
       sizes=st.lists(st.floats(1.0, 2.0**44), min_size=2, max_size=2))
def test_any_measured_table_prices_more_bytes_at_no_less_time(rates, sizes):
    """Measured tables dip (NVLink 3's: 2 MB in less time than 1 MB, 16 MB below 8 MB's
    bus bandwidth); the price takes the running maximum of their times."""
    link = LinkSpec(name="measured", bandwidth=1e11, latency=5e-6, bus_rates=tuple(
        BusRate(size=2.0**exponent, bus_bandwidth=busbw) for exponent, busbw in sorted(rates)))
    group = CommGroup((("a", 4),))
    small, large = sorted(sizes)
    assert (collective_over(Collective.ALL_REDUCE, small, group, link, None)
            <= collective_over(Collective.ALL_REDUCE, large, group, link, None))
