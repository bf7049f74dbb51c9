"""Checkpoints with torch.distributed.checkpoint (DCP), and resuming from the latest.

Layout: RUN_DIR/checkpoints/step-00000010/ is the state after 10 optimizer steps.
Every rank saves its stage's model and optimizer state, keyed by the parameter
names of the whole model (`get_state_dict` with a flattened optimizer state),
so a parameter that several ranks hold (replicas, tied weights) is written once
and a DTensor (tensor-parallel or FSDP shard) as one global tensor. A parameter
held by stages of different tensor-parallel degrees is written by those of one
degree (DCP cannot merge a whole copy with shards); loading reshards it. DCP writes
`.metadata` last, after every rank's data, so a directory without it (a crash
during the save) is never resumed from.

The directory must be visible to all ranks at the same path (a shared file
system for multi-node runs).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

_NAME = re.compile(r"^step-(\d{8})$")


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def complete_steps(run_dir: Path) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match and (entry / ".metadata").is_file():
            steps.append(int(match[1]))
    return sorted(steps)


def latest_step(run_dir: Path) -> int | None:
    """The latest complete checkpoint's step, agreed on by all ranks (rank 0 looks)."""
    found = complete_steps(run_dir)
    choice: list[int | None] = [found[-1] if found else None]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _options() -> object:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save(run_dir: Path, step: int, root: nn.Module, optimizer: torch.optim.Optimizer,
         others: frozenset[str] = frozenset()) -> Path:
    """Save this rank's state, leaving out the parameters in `others` (and their
    optimizer states), which ranks laid out differently write (`parallel.written_by_others`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(root, optimizer, options=_options())
    model_state = {k: v for k, v in model_state.items() if k not in others}
    optim_state = {k: v for k, v in optim_state.items()
                   if not (k.startswith("state.") and k[6:].rsplit(".", 1)[0] in others)}
    path = step_dir(run_dir, step)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
    return path


def load(run_dir: Path, step: int, root: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(root, optimizer, options=_options())
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(step_dir(run_dir, step)))
    set_state_dict(root, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_options())


def load_full_model(path: Path, module: nn.Module) -> None:
    """Load a checkpoint's parameters into a whole (single-process) model, e.g. to
    compare a distributed run with single-process training or to export it."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": module.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    module.load_state_dict(state["model"])
