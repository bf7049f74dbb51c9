"""The training a plan must reproduce, in one process: the whole model, initialized as
the runtime initializes its stages, on the whole global batch of every step, with
the same optimizer. A correct distributed run matches its losses and final
parameters to floating-point tolerance.

    losses, model = train_reference(plan, steps=5, seed=0, lr=1e-3)
    losses, model = train_reference(plan, steps=8, start=RUN_DIR / "checkpoints/step-00000004")

`start` resumes from a checkpoint (model and optimizer state, resharded into the whole
model as `checkpoint.resume` reshards into a stage) and returns the losses of the steps
after it: what a run resumed from that checkpoint, under any plan, must reproduce.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from planner.runtime.data import Batches
from planner.runtime.stage import ModelInfo, inspect_model, materialize
from planner.types import Plan


def build_reference(plan: Plan, seed: int) -> tuple[ModelInfo, nn.Module]:
    """The model as the runtime inspects it (so a data hook's batches are checked against
    the same vocabulary and classes) and the whole of it initialized as the stages are."""
    info = inspect_model(plan)
    return info, materialize(info.module, seed)


def train_reference(plan: Plan, *, steps: int, seed: int = 0, lr: float = 1e-3,
                    optimizer: str = "adamw", data: str | None = None,
                    start: Path | None = None) -> tuple[list[float], nn.Module]:
    """Per-step losses and the trained model (fp32 on the CPU); from a checkpoint folder
    `start` (step K), the losses of steps K+1 to `steps`."""
    info, model = build_reference(plan, seed)
    model.train()
    batch = plan.training.global_batch
    batches = Batches(info.loaded, global_batch=batch, seed=seed, hook=data, vocab=info.vocab,
                      classes=info.classes)
    params = list(model.parameters())
    opt = (torch.optim.SGD(params, lr=lr) if optimizer == "sgd"
           else torch.optim.AdamW(params, lr=lr, weight_decay=0.0))
    first = 0
    if start is not None:
        import warnings

        from planner.runtime.checkpoint import _load

        first = int(Path(start).name.rpartition("-")[2])  # step-00000004
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            _load(Path(start), model, opt)
    losses = []
    for step in range(first, steps):
        inputs, targets = batches.get(step, 0, batch)
        loss = info.loaded.loss(model(*inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, model
