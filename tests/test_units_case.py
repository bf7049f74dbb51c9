"""Units in any case where the case cannot change the meaning (planner.units): prefixes
always, bits or bytes only where the letter B is not the one thing telling them apart."""

from __future__ import annotations

import pytest

from cost_models.cluster import load_cluster
from planner.errors import PlannerError
from planner.units import parse_bandwidth, parse_bytes, parse_flops

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@pytest.mark.parametrize("text, value", [
    # bps is bits in any case but the one that marks bytes, Bps
    ("100gbps", 100 * GBIT), ("100Gbps", 100 * GBIT), ("100GBPS", 100 * GBIT),
    ("100 MBPS", 100e6 / 8), ("25GBps", 25e9), ("25 Bps", 25.0),
    # spelled-out bits, in any case
    ("25GBIT/s", 25 * GBIT), ("25gbit/s", 25 * GBIT), ("25 Gbits/S", 25 * GBIT),
    # a lone letter B decides: bytes where capital, bits where not; /s in any case
    ("25GB/s", 25e9), ("25Gb/s", 25 * GBIT), ("25GB/S", 25e9), ("25gb/s", 25 * GBIT),
    ("2 gib/s", 2 * 2**30 / 8), ("2 GiB/s", 2 * 2**30),
    # prefixes in any case: m is mega (there are no millibits per second), k kilo
    ("100mbps", 100e6 / 8), ("1 kbps", 125.0), ("1 Kbps", 125.0), ("1 pbps", 1e15 / 8),
])
def test_bandwidths_in_any_case_that_keeps_their_meaning(text, value):
    assert parse_bandwidth(text) == pytest.approx(value)


def test_sizes_and_flops_read_their_prefixes_in_any_case():
    assert parse_bytes("80giB") == parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40 gB") == parse_bytes("40 GB") == 40e9
    assert parse_flops("312 tflops") == parse_flops("312 TFLOPS") == 312e12
    assert parse_flops("1 pflop/s") == 1e15
    with pytest.raises(PlannerError, match="as a size"):  # bits are no size
        parse_bytes("80 gb")


def test_an_amount_given_for_a_rate_suggests_the_rate():
    with pytest.raises(PlannerError) as error:
        parse_bandwidth("25 Gbit", "the network")
    assert ("Cannot read '25 Gbit' as a bandwidth (for the network); did you mean "
            "'25 Gbit/s'? Write it like '100Gbps'") in error.value.message
    with pytest.raises(PlannerError) as error:
        parse_bandwidth("fast")
    assert "did you mean" not in error.value.message


def test_an_inline_cluster_reads_its_network_in_any_case():
    """`25GBIT/S`'s slash is the unit's, as `25GB/s`'s is, latency or not."""
    assert load_cluster("1x2xA100-80G@25GBIT/S").network.bandwidth == 25 * GBIT
    network = load_cluster("1x2xA100-80G@100GBPS/2us").network
    assert network.bandwidth == 100 * GBIT and network.latency == 2e-6
