"""The data model every pass speaks: frozen, keyword-only value objects in SI units.

model.py:    ModelSpec, Kernel, Layer, ModelGraph (what tracing produces)
cluster.py:  LinkSpec, DeviceSpec, Measured*, NodeSpec, GroupSpec, ClusterSpec
training.py: OptimizerSpec, Recompute, SyncSpec, TrainingSpec
plan.py:     Plan, PipelinePlan, StagePlan, DeviceGroup, MemoryBreakdown, CostBreakdown,
             SolverReport, Baseline, Schedule, SyncAlgorithm
"""

from planner.types.cluster import (
    ClusterSpec,
    DeviceSpec,
    GroupSpec,
    LayerTiming,
    LinkSpec,
    MeasuredDevice,
    NodeSpec,
    OptimizerTiming,
)
from planner.types.model import (
    SCHEMA_VERSION,
    Kernel,
    Layer,
    LayerKind,
    ModelGraph,
    ModelSpec,
    OpClass,
)
from planner.types.plan import (
    Baseline,
    CostBreakdown,
    DeviceGroup,
    MemoryBreakdown,
    PipelinePlan,
    Plan,
    Schedule,
    SolverReport,
    StagePlan,
    SyncAlgorithm,
)
from planner.types.training import OptimizerSpec, Recompute, SyncSpec, TrainingSpec

__all__ = [
    "SCHEMA_VERSION", "Baseline", "ClusterSpec", "CostBreakdown", "DeviceGroup", "DeviceSpec",
    "GroupSpec", "Kernel", "Layer", "LayerKind", "LayerTiming", "LinkSpec", "MeasuredDevice",
    "MemoryBreakdown", "ModelGraph", "ModelSpec", "NodeSpec", "OpClass", "OptimizerSpec",
    "OptimizerTiming", "PipelinePlan", "Plan", "Recompute", "Schedule", "SolverReport",
    "StagePlan", "SyncAlgorithm", "SyncSpec", "TrainingSpec",
]
