"""Check the cost model against the machine: after profiling, predict a model's layer
times and local all-reduces with the profile-calibrated cost model, measure them afresh,
and report the relative errors (used by a test and by benchmarks/cost_model.py)."""

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


@dataclass(frozen=True)
class Check:
    what: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def calibrate(model: str, *, quick: bool = True, processes: int = 2,
              workdir: Path | None = None) -> ClusterSpec:
    """Profile this machine's CPU (layers of `model`, gloo among `processes`) and merge."""
    doc = run_profile(quick=quick, model=model, processes=processes, devices="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(workdir or tmp) / "profile.json"
        path.write_text(json.dumps(doc))
        return merge_profiles([path], network="measured", name="this machine")


def check(model: str, cluster: ClusterSpec, *, quick: bool = True, processes: int = 2
          ) -> tuple[list[Check], list[Check]]:
    """(layer checks per micro-batch: the model's forward+backward summed over layers;
    all-reduce checks per message size), predicted by the calibrated cost model vs
    measured now."""
    costs = AnalyticalCostModel(cluster)
    node = cluster.nodes[0]
    fresh = profile_layers(model, seq_len=None, dtype="fp32", device=torch.device("cpu"),
                           quick=quick, tick=lambda _: None)
    meta = load_model(model_spec(model), seq_len=fresh["seq_len"])
    layers = trace_loaded(meta, batch=1, dtype="fp32").layers
    layer_checks = []
    for mb in sorted({t["micro_batch"] for t in fresh["timings"]}):
        measured = sum(t["fwd"] + t["bwd"] for t in fresh["timings"]
                       if t["micro_batch"] == mb)
        predicted = sum(costs.layer_time(layer, node.device, tp=1, micro_batch=mb,
                                         dtype="fp32").total for layer in layers)
        layer_checks.append(Check(f"{model} layers, micro-batch {mb}", predicted, measured))
    comm = measure_comm(processes=processes, device="cpu", quick=quick)
    group = CommGroup(((node.name, processes),))
    comm_checks = [Check(f"all-reduce {int(point['bytes'])} B",
                         costs.collective_time(Collective.ALL_REDUCE, point["bytes"], group),
                         point["seconds"])
                   for point in comm["collectives"]["all_reduce"]["sweep"]]
    return layer_checks, comm_checks
