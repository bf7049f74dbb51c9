"""benchmarks/fidelity.py's inputs and its account of the rows it misses (issue 47): the
A100's NVLink as NCCL reaches it, and what else was checked against its source."""

import pytest

from cost_models import catalog
from cost_models.cluster import load_cluster
from cost_models.comm import Collective, CommGroup, collective_time

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
        2 * 7 / 8 * GB / (230 * GB) + 2 * 7 * 2e-6)
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
