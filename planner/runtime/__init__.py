"""Run a plan on real torch.distributed: `python -m planner.runtime --plan plan.json`.

What the scripts `planner launch` writes start on every rank (through torchrun).

layout.py:     which rank runs which (pipeline, stage, tensor-parallel shard)
env.py:        the environment checked against the plan before anything else
stage.py:      the model on meta, the chain check, this rank's stage materialized
data.py:       synthetic batches or a user hook, sliced per pipeline
parallel.py:   process groups and device meshes, tensor parallel, FSDP2, gradient sums
schedule.py:   the pipeline schedule (torch.distributed.pipelining)
follow.py:     a stage's ranks outside its pipeline's chains, mirroring the first
checkpoint.py: torch.distributed.checkpoint saves (atomic, hashed) and verified resume
guard.py:      each step's check: NaN/inf loss or gradients, a stop request (SIGUSR1)
summary.py:    step logs and the run summary
train.py:      `run(RunOptions, env)`, the whole thing
node.py:       `python -m planner.runtime.node`: a node's launcher (arrival, torchrun)
failures.py:   why a run failed, and which rank failed first
supervise.py:  `python -m planner.runtime.supervise`: a lost node re-planned around, resumed
reference.py:  the same training in one process, for checking a run
"""

from __future__ import annotations

from typing import Any

__all__ = ["RunOptions", "run"]


def __getattr__(name: str) -> Any:
    """`run` and `RunOptions` load torch.distributed on first use, so that importing
    `planner.runtime.layout` (the launch scripts' renderer does) stays light."""
    if name in __all__:
        from planner.runtime import train

        return getattr(train, name)
    raise AttributeError(name)
