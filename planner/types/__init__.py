"""The data model every pass speaks: frozen, keyword-only value objects in SI units.

model.py:    ModelSpec, Kernel, Layer, ModelGraph (what tracing produces)
cluster.py:  LinkSpec, DeviceSpec, Measured*, NodeSpec, GroupSpec, ClusterSpec
training.py: OptimizerSpec, TrainingSpec
"""

from planner.types.cluster import (
    ClusterSpec,
    DeviceSpec,
    GroupSpec,
    LayerTiming,
    LinkSpec,
    MeasuredDevice,
    NodeSpec,
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
from planner.types.training import OptimizerSpec, Recompute, TrainingSpec

__all__ = [
    "SCHEMA_VERSION", "ClusterSpec", "DeviceSpec", "GroupSpec", "Kernel", "Layer", "LayerKind",
    "LayerTiming", "LinkSpec", "MeasuredDevice", "ModelGraph", "ModelSpec", "NodeSpec",
    "OpClass", "OptimizerSpec", "Recompute", "TrainingSpec",
]
