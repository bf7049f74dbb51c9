"""Check the cost model against the machine: after profiling, predict a model's layer
times and local all-reduces with the profile-calibrated cost model, measure them afresh,
and report the relative errors.

    cluster = calibrate("gpt2-small")            # profile this CPU, merge: measures
    checks = check("gpt2-small", cluster)        # measure again and compare: measures
    checks = compare(model, cluster, layers, comm)  # the comparison alone: pure

Measuring twice on a shared machine gives two different machines (its load changes
from minute to minute), so the measured comparison is a benchmark
(benchmarks/cost_model.py), and the tests feed `calibrated_cluster` and `compare`
made-up measurements.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cost_models.comm import Collective, CommGroup
from cost_models.model import AnalyticalCostModel
from cost_models.profile import run_profile
from cost_models.profile.comm import measure_comm
from cost_models.profile.layers import profile_layers
from cost_models.profile.merge import merge_profiles
from planner.models import load_model, model_spec
from planner.trace import trace_loaded
from planner.types import ClusterSpec

# gloo messages under 4 MiB take one or two scheduler ticks on a shared machine, so
# their time varies by 30% from run to run; the claim is for the bandwidth-bound sizes
# that carry gradient buckets
BIG_MESSAGE = 4 * 2**20


@dataclass(frozen=True)
class Check:
    what: str
    predicted: float  # seconds
    measured: float  # seconds
    nbytes: float = 0.0  # the message of an all-reduce check

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Checks:
    """The calibrated cost model's predictions beside measurements."""

    layers: list[Check]  # the model's layers, forward + backward summed, per micro-batch
    all_reduce: list[Check]  # one per message size

    def close(self, tolerance: float) -> bool:
        """Every layer check, and every all-reduce of at least BIG_MESSAGE bytes (of
        which there must be one), within `tolerance` relative error."""
        big = [c for c in self.all_reduce if c.nbytes >= BIG_MESSAGE]
        return (bool(self.layers) and bool(big)
                and all(abs(c.error) <= tolerance for c in self.layers + big))


def calibrate(model: str, *, quick: bool = True, processes: int = 2) -> ClusterSpec:
    """Profile this machine's CPU (layers of `model`, gloo among `processes`) and merge."""
    return calibrated_cluster(run_profile(quick=quick, model=model, processes=processes,
                                          devices="cpu"))


def calibrated_cluster(doc: dict) -> ClusterSpec:
    """The one-node cluster that `planner profile merge --network measured` makes of
    the profile `doc`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        path.write_text(json.dumps(doc))
        return merge_profiles([path], network="measured", name="this machine")


def check(model: str, cluster: ClusterSpec, *, quick: bool = True, processes: int = 2
          ) -> Checks:
    """Measure `model`'s layers and the all-reduces among `processes` again, and
    `compare` the calibrated cost model's predictions with them."""
    fresh = profile_layers(model, seq_len=None, dtype="fp32", device=torch.device("cpu"),
                           quick=quick, tick=lambda _: None)
    return compare(model, cluster, fresh,
                   measure_comm(processes=processes, device="cpu", quick=quick))


def compare(model: str, cluster: ClusterSpec, layers: dict, comm: dict) -> Checks:
    """`cluster`'s cost model against measurements: `layers` as a profile's layer
    timings of `model` (fp32), `comm` as its communication; each layer check sums
    forward and backward over the model's layers at one micro-batch size."""
    costs = AnalyticalCostModel(cluster)
    node = cluster.nodes[0]
    meta = load_model(model_spec(model), seq_len=layers["seq_len"])
    traced = trace_loaded(meta, batch=1, dtype="fp32").layers
    layer_checks = []
    for mb in sorted({t["micro_batch"] for t in layers["timings"]}):
        measured = sum(t["fwd"] + t["bwd"] for t in layers["timings"]
                       if t["micro_batch"] == mb)
        predicted = sum(costs.layer_time(layer, node.device, tp=1, micro_batch=mb,
                                         dtype="fp32").total for layer in traced)
        layer_checks.append(Check(f"{model} layers, micro-batch {mb}", predicted, measured))
    group = CommGroup(((node.name, comm["world_size"]),))
    comm_checks = [Check(f"all-reduce {int(point['bytes'])} B",
                         costs.collective_time(Collective.ALL_REDUCE, point["bytes"], group),
                         point["seconds"], point["bytes"])
                   for point in comm["collectives"]["all_reduce"]["sweep"]]
    return Checks(layer_checks, comm_checks)
