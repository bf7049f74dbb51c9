"""The training a plan must reproduce, in one process: the whole model, initialized as
the runtime initializes its stages, on the whole global batch of every step, with
the same optimizer. A correct distributed run matches its losses and final
parameters to floating-point tolerance.

    losses, model = train_reference(plan, steps=5, seed=0, lr=1e-3)
"""

from __future__ import annotations

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
                    optimizer: str = "adamw", data: str | None = None
                    ) -> tuple[list[float], nn.Module]:
    """Per-step losses and the trained model (fp32 on the CPU)."""
    info, model = build_reference(plan, seed)
    model.train()
    batch = plan.training.global_batch
    batches = Batches(info.loaded, global_batch=batch, seed=seed, hook=data, vocab=info.vocab,
                      classes=info.classes)
    params = list(model.parameters())
    opt = (torch.optim.SGD(params, lr=lr) if optimizer == "sgd"
           else torch.optim.AdamW(params, lr=lr, weight_decay=0.0))
    losses = []
    for step in range(steps):
        inputs, targets = batches.get(step, 0, batch)
        loss = info.loaded.loss(model(*inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, model
