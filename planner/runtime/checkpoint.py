"""Checkpoints with torch.distributed.checkpoint (DCP): written atomically, verified on
resume, and resumed from the newest intact one.

Layout: RUN_DIR/checkpoints/step-00000010/ is the state after 10 optimizer steps: DCP's
shards (`__<rank>_<n>.distcp`), its `.metadata`, and `manifest.json`. Every rank saves
its stage's model and optimizer state, keyed by the parameter names of the whole model
(`get_state_dict` with a flattened optimizer state), so a parameter that several ranks
hold (replicas, tied weights) is written once and a DTensor (tensor-parallel or FSDP
shard) as one global tensor; loading reshards, so a checkpoint written under one plan
loads under another of the same model. A parameter held by stages of different
tensor-parallel degrees is written by those of one degree (DCP cannot merge a whole
copy with shards).

Writing is atomic: DCP writes into `.step-00000010.partial/`, every rank hashes the
shards it wrote (SHA-256), and rank 0 writes the manifest (each file's bytes and hash,
the model's fingerprint, the optimizer, the plan's fingerprint) and only then renames
the folder: a `step-...` folder is whole, and a crash mid-save leaves only a partial
one, which nothing reads.

Resuming (`resume`) takes the checkpoints newest first and loads the first that is
intact: its manifest names this run's model and optimizer (else it is foreign), every
file it lists has its size and hash (the ranks share the hashing), and DCP loads it.
Each one passed over is reported with the file or field at fault; if none is intact the
run stops with that list rather than start again from step 0. Checkpoints written
before manifests (a `.metadata`, no manifest) are loaded unverified.

The directory must be visible to all ranks at the same path (a shared file system for
multi-node runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import PlannerError

_NAME = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def _partial_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f".step-{step:08d}.partial"


def complete_steps(run_dir: Path) -> list[int]:
    """Steps with a whole checkpoint folder (a manifest, or an older checkpoint's DCP
    `.metadata`), ascending; whether its files are intact is `resume`'s question."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match and ((entry / MANIFEST).is_file() or (entry / ".metadata").is_file()):
            steps.append(int(match[1]))
    return sorted(steps)


@dataclass(frozen=True)
class Identity:
    """What a checkpoint must share with the run that resumes it (model, optimizer), and
    what it may not (the plan, recorded to say that the state was resharded)."""

    model: str  # fingerprint of the whole model's parameter names and shapes
    description: str  # the model as people name it
    params: int
    optimizer: str
    plan: str  # fingerprint of the plan file's content


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def identity(model: nn.Module, description: str, optimizer: str, plan_text: str) -> Identity:
    """The Identity of a run training `model` (on meta is enough) with `optimizer` under
    the plan whose file content is `plan_text`."""
    shapes = [[name, list(p.shape)] for name, p in model.named_parameters()]
    return Identity(model=_digest(json.dumps(shapes)), description=description,
                    params=sum(p.numel() for p in model.parameters()), optimizer=optimizer,
                    plan=_digest(plan_text))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _options() -> object:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _gather(value: Any) -> list[Any]:
    """Every rank's `value` (a collective), or [value] without a process group."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _from_rank0(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _fsync_dir(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _publish(partial: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Rank 0: write the manifest into the partial folder and rename it into place. A
    folder already there (a damaged checkpoint of this step that a resume passed over)
    is kept aside as step-....damaged-N, never deleted."""
    path = partial / MANIFEST
    with path.open("w") as out:
        out.write(json.dumps(manifest, indent=1) + "\n")
        out.flush()
        os.fsync(out.fileno())
    if final.exists():
        n = 1
        while final.with_name(f"{final.name}.damaged-{n}").exists():
            n += 1
        final.rename(final.with_name(f"{final.name}.damaged-{n}"))
    partial.rename(final)
    _fsync_dir(final.parent)


def save(run_dir: Path, step: int, root: nn.Module, optimizer: torch.optim.Optimizer,
         who: Identity, others: frozenset[str] = frozenset(),
         extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Save this rank's state (a collective), leaving out the parameters in `others` (and
    their optimizer states), which ranks laid out differently write
    (`parallel.written_by_others`); see the module docstring for the atomic write.
    `extra`: more state by parameter name (DiLoCo's outer optimizer,
    `sync_modes.Averaging.outer_state`), written under the key "extra"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(root, optimizer, options=_options())
    model_state = {k: v for k, v in model_state.items() if k not in others}
    optim_state = {k: v for k, v in optim_state.items()
                   if not (k.startswith("state.") and k[6:].rsplit(".", 1)[0] in others)}
    partial, final = _partial_dir(run_dir, step), step_dir(run_dir, step)
    rank = _rank()
    if rank == 0 and partial.exists():  # an earlier attempt's, cut short
        shutil.rmtree(partial)
    _from_rank0(None)  # (no rank writes before it is gone)
    state = {"model": model_state, "optim": optim_state}
    if extra:
        state["extra"] = {kind: {k: v for k, v in values.items() if k not in others}
                          for kind, values in extra.items()}
    dcp.save(state, checkpoint_id=str(partial))
    mine = {entry.name: _record(entry) for entry in sorted(partial.iterdir())
            if entry.name.startswith(f"__{rank}_")}
    files = {name: record for part in _gather(mine) for name, record in part.items()}
    problem = None
    if rank == 0:
        files[".metadata"] = _record(partial / ".metadata")
        manifest = {"kind": "checkpoint", "schema_version": 1, "step": step,
                    "model": who.model, "model_description": who.description,
                    "params": who.params, "optimizer": who.optimizer, "plan": who.plan,
                    "files": dict(sorted(files.items()))}
        try:
            _publish(partial, final, manifest)
        except OSError as exc:
            problem = f"{exc.filename or final}: {exc.strerror or exc}"
    problem = _from_rank0(problem)
    if problem:
        raise PlannerError("bad-path", f"The checkpoint of step {step} could not be "
                           f"written: {problem}.", ["free space or permissions in --run-dir"])
    return final


def _check(folder: Path, who: Identity, rank: int, world: int) -> str | None:
    """This rank's finding on `folder`: a problem naming the file or field at fault, or
    None (intact as far as this rank's share of the files goes)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None  # written before manifests (complete_steps saw its .metadata)
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        model, optimizer = manifest["model"], manifest["optimizer"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} cannot be read ({type(exc).__name__}: {exc})"
    if model != who.model:
        return (f"it holds another model: {manifest.get('model_description', '?')} "
                f"({manifest.get('params', 0):,} parameters), where this run trains "
                f"{who.description} ({who.params:,} parameters)")
    if optimizer != who.optimizer:
        return (f"it holds {optimizer} optimizer state, where this run uses {who.optimizer} "
                "(--optimizer)")
    for name in sorted(files)[rank::world]:
        entry, expected = folder / name, files[name]
        if not entry.is_file():
            return f"{name} is missing"
        try:
            size, digest = entry.stat().st_size, _sha256(entry)
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
        if size != expected["bytes"]:
            return (f"{name} has {size:,} bytes where the manifest says "
                    f"{expected['bytes']:,} (truncated or overwritten)")
        if digest != expected["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (its bytes changed)"
    return None


def _plan_of(folder: Path) -> str | None:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("plan")
    except (OSError, ValueError, AttributeError):
        return None


def _load(folder: Path, root: nn.Module, optimizer: torch.optim.Optimizer,
          extra: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """Load a checkpoint into the stage, its optimizer and `extra` (in place)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(root, optimizer, options=_options())
    state = {"model": model_state, "optim": optim_state} | ({"extra": extra} if extra else {})
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(root, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_options())


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from, and those it passed over (with why)."""

    step: int
    folder: Path
    passed_over: tuple[str, ...]
    verified: bool  # False: written before manifests
    other_plan: bool  # written under another plan (the state was resharded)


def _first_problem(found: list[str | None]) -> str | None:
    return next((p for p in found if p), None)


def resume(run_dir: Path, root: nn.Module, optimizer: torch.optim.Optimizer,
           who: Identity, extra: dict[str, dict[str, torch.Tensor]] | None = None
           ) -> Resumed | None:
    """Load the newest intact checkpoint (a collective; every rank takes the same one),
    or None where the run directory holds none; a PlannerError where it holds some but
    none is intact. `extra` as `save` wrote it, loaded in place."""
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    steps = _from_rank0(complete_steps(run_dir) if rank == 0 else None)
    passed: list[str] = []
    for step in reversed(steps):
        folder = step_dir(run_dir, step)
        problem = _first_problem(_gather(_check(folder, who, rank, world)))
        if problem is None:
            try:
                _load(folder, root, optimizer, extra)
            except Exception as exc:  # DCP's CheckpointException, a pickle error, ...
                mine: str | None = (f"loading it failed: "
                                    f"{str(exc).strip().splitlines()[-1] or type(exc).__name__}")
            else:
                mine = None
            problem = _first_problem(_gather(mine))
        if problem is None:
            plan = _plan_of(folder)
            return Resumed(step=step, folder=folder, passed_over=tuple(passed),
                           verified=(folder / MANIFEST).is_file(),
                           other_plan=plan is not None and plan != who.plan)
        passed.append(f"{folder.name}: {problem}")
    if passed:
        more = f"; and {len(passed) - 3} older ones" if len(passed) > 3 else ""
        raise PlannerError(
            "bad-checkpoint", f"{run_dir / 'checkpoints'} holds no checkpoint this run can "
            f"resume from: {'; '.join(passed[:3])}{more}.",
            ["resume with the model, optimizer and run directory of that run",
             "or start afresh with another --run-dir (this one is left as it is)"])
    return None


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
