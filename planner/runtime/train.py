"""Train with a plan: validate, build this rank's stage, run the steps, checkpoint.

    run(RunOptions(plan=Path("plan.json"), steps=20), os.environ)

Order of work on every rank:
  1. read the plan, lay out the ranks, check the environment (no collective yet);
  2. join the process group; build the model on meta and check its layers chain;
  3. create every process group and this rank's device meshes;
  4. materialize only this rank's stage (deterministic values), then tensor
     parallelism, recompute, FSDP2 (in that order);
  5. resume from the newest intact checkpoint (--resume), else start at step 0;
  6. per step: the pipeline schedule (forward, loss, backward over the micro-
     batches; a follower mirrors its stage's leader instead, `follow.py`),
     gradient sums over the holders of each parameter, the step's check (one
     all-reduce: the global loss, NaN/inf gradients, a stop request, `guard.py`),
     the optimizer step unless the check failed, logs; a checkpoint every K steps;
  7. a final checkpoint (unless turned off) and the run summary. A stop request
     (SIGUSR1) ends the run after the step with a checkpoint and `stopped.json`.

Ranks: the plan numbers them (`layout.py`). torchrun's static rendezvous numbers them
alike; under its c10d rendezvous (the launch scripts', `PLANNER_RANKS=plan`) torchrun
numbers nodes as they arrive, so each rank takes its plan rank from PLANNER_NODE and
LOCAL_RANK and joins a store that torchrun's rank 0 hosts, fresh in every attempt.

Training dtype: fp32 and tf32 train in fp32 (tf32 allows TF32 matmuls on CUDA);
bf16 and fp16 keep fp32 parameters and optimizer state and run the forward
under autocast; fp16 multiplies the loss by a fixed 2**12 and skips steps whose
gradients overflow on any rank.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.data.profile import read_profile
from planner.errors import PlannerError
from planner.planfile import plan_json, read_plan
from planner.runtime import checkpoint, failures
from planner.runtime.data import Batches
from planner.runtime.env import validate_environment
from planner.runtime.follow import Follower
from planner.runtime.guard import (
    MAX_SKIPPED,
    ON_NONFINITE,
    BadRank,
    StopRequest,
    bad_gradients,
    check_parameters,
    check_step,
    gather_bad_ranks,
    nonfinite_error,
)
from planner.runtime.layout import rank_layout
from planner.runtime.overlap import (
    AfterBackward,
    Overlapped,
    SyncTiming,
    accumulations,
    overlap_buckets,
    sync_groups,
)
from planner.runtime.packed import PACKINGS, packed_feed
from planner.runtime.parallel import (
    GradientSum,
    apply_fsdp,
    apply_tensor_parallel,
    build_groups,
    fsdp_ignored,
    fsdp_managed,
    topology,
    written_by_others,
)
from planner.runtime.schedule import PipelineRunner
from planner.runtime.stage import apply_recompute, build_stage, inspect_model
from planner.runtime.summary import (
    StepLog,
    log,
    peak_memory,
    sync_means,
    sync_summary,
    timing,
    write_summary,
)
from planner.runtime.sync_modes import (
    Averaging,
    check_checkpoints,
    holder_weights,
    loss_weight,
    reported_loss,
    within_pipelines,
)

FP16_SCALE = 2.0**12
STOPPED = "stopped.json"  # written where a stop request ended the run before --steps


MAX_TIMEOUT = 7 * 24 * 3600  # seconds a collective may wait at most (torch takes whole ms)


@dataclass(frozen=True)
class RunOptions:
    plan: Path
    run_dir: Path | None = None  # default: runs/<plan file stem>
    steps: int = 10
    checkpoint_every: int = 0  # 0: no periodic checkpoints
    final_checkpoint: bool = True
    resume: bool = False
    data: str | None = None  # package.module:function
    seed: int = 0
    lr: float = 1e-3
    optimizer: str | None = None  # adamw or sgd; default from the plan (adam -> adamw)
    cpu: bool = False  # every rank on the CPU with gloo (the local target)
    check_device_type: bool = True
    warmup: int = 1  # steps left out of the timing
    timeout: float = 600.0  # seconds a collective may wait
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient: stop the run, or skip the step
    lengths: Path | None = None  # a data profile: synthetic samples of its lengths (`packed.py`)
    packing: str = "balanced"  # variable-length samples into micro-batches: or "naive"
    bucket_mb: float | None = None  # overlapped sums: MiB per all-reduce; None: the plan's
    outer_lr: float = 0.7  # DiLoCo's outer optimizer (`sync_modes.py`)
    outer_momentum: float = 0.9

    def resolved_run_dir(self) -> Path:
        return self.run_dir or Path("runs") / self.plan.stem


def check_options(options: RunOptions) -> None:
    """An error naming the first option out of range."""
    if options.steps < 1:
        raise PlannerError("bad-option", f"--steps must be at least 1 (got {options.steps}).")
    if options.checkpoint_every < 0:
        raise PlannerError("bad-option", "--checkpoint-every must be 0 (off) or positive "
                           f"(got {options.checkpoint_every}).")
    if not (options.lr > 0 and math.isfinite(options.lr)):
        raise PlannerError("bad-option", f"--lr must be a positive number (got {options.lr}).")
    if options.warmup < 0:
        raise PlannerError("bad-option", f"--warmup must be 0 or more (got {options.warmup}).")
    if not 0 < options.timeout <= MAX_TIMEOUT:
        raise PlannerError("bad-option", f"--timeout must be positive seconds, at most "
                           f"{MAX_TIMEOUT:,} (a week) (got {options.timeout}).")
    if not 0 <= options.seed < 2**63:
        raise PlannerError("bad-option", f"--seed must be between 0 and 2**63 - 1 (got "
                           f"{options.seed}).")

    if options.optimizer not in (None, "adamw", "sgd"):
        raise PlannerError("bad-option", f"--optimizer must be adamw or sgd (got "
                           f"{options.optimizer!r}).")
    if options.bucket_mb is not None and not (options.bucket_mb > 0
                                              and math.isfinite(options.bucket_mb)):
        raise PlannerError("bad-option", f"--bucket-mb must be a positive number of MiB (got "
                           f"{options.bucket_mb}).")
    if not (options.outer_lr > 0 and math.isfinite(options.outer_lr)):
        raise PlannerError("bad-option", f"--outer-lr must be a positive number (got "
                           f"{options.outer_lr}).")
    if not 0 <= options.outer_momentum < 1:
        raise PlannerError("bad-option", f"--outer-momentum must be at least 0 and below 1 "
                           f"(got {options.outer_momentum}).")
    if options.packing not in PACKINGS:
        raise PlannerError("bad-option", f"--packing must be balanced or naive (got "
                           f"{options.packing!r}).")
    if options.lengths is not None and options.data is not None:
        raise PlannerError("bad-option", "Give --lengths (synthetic samples of a data "
                           "profile's lengths) or --data (a data hook), not both.")
    if options.on_nonfinite not in ON_NONFINITE:
        raise PlannerError("bad-option", f"--on-nonfinite must be stop or skip (got "
                           f"{options.on_nonfinite!r}).")


def checkpoint_warning(steps: int, every: int, first: int = 0) -> str | None:
    """A warning where --checkpoint-every asks for periodic checkpoints that steps
    first+1..steps never reach (only the final one is saved)."""
    if every and every >= steps - first:
        return (f"--checkpoint-every {every} with {steps - first} step(s) to run "
                f"(to step {steps}): no periodic checkpoint, only the final one")
    return None


def _optimizer(params: list, name: str, lr: float) -> torch.optim.Optimizer:
    from torch.distributed.tensor import DTensor

    mixed = any(isinstance(p, DTensor) for p in params) and not all(
        isinstance(p, DTensor) for p in params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False if mixed else None)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False if mixed else None)


def _to_device(tree: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, tree)


def run(options: RunOptions, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """Train with the plan; rank 0 returns the run summary (other ranks None). A failure
    is also recorded for the launcher's report (`failures.record`)."""
    env = dict(os.environ if env is None else env)
    try:
        return _run(options, env)
    except BaseException as exc:
        failures.record(env, exc)
        raise


def _run(options: RunOptions, env: dict[str, str]) -> dict[str, Any] | None:
    check_options(options)
    run_dir = options.resolved_run_dir()
    for folder in (run_dir, *run_dir.parents):
        if folder.exists() and not folder.is_dir():
            raise PlannerError("bad-path", f"--run-dir {str(run_dir)!r}: {str(folder)!r} is a "
                               "file, not a folder; the run writes its checkpoints, logs and "
                               "summary there.", ["give a folder, e.g. --run-dir runs/try"])
    plan = read_plan(options.plan)
    layout = rank_layout(plan)
    place = validate_environment(plan, layout, env, cpu=options.cpu,
                                 check_device_name=options.check_device_type)
    rank = place.slot.rank
    if place.device.type == "cuda":
        torch.cuda.set_device(place.device)
    stop = StopRequest()
    stop.install()
    _init_process_group(place.backend, rank, layout.world_size, env,
                        datetime.timedelta(seconds=options.timeout))
    try:
        attempt = _job_attempt(env, place)
        return _train(options, plan, layout, place, run_dir, attempt, stop)
    finally:
        # the model, FSDP and the schedules hold the groups in reference cycles: freed
        # now, the groups' worker threads end while the interpreter is alive (left to
        # interpreter exit, gloo's sometimes aborted the rank after a finished run)
        gc.collect()
        dist.destroy_process_group()


def _init_process_group(backend: str, rank: int, world: int, env: dict[str, str],
                        timeout: datetime.timedelta) -> None:
    """Join the process group as plan rank `rank`. Where torchrun shares its agent's store
    (its static rendezvous), that store outlives restarts (torch prefixes nothing then),
    so each attempt uses keys of its own and never meets the dead attempt's addresses;
    otherwise the process torchrun (or the caller) made rank 0 hosts a fresh store at
    MASTER_ADDR:MASTER_PORT (under the c10d rendezvous, a new port every attempt)."""
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    try:
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"planner/attempt-{restarts}", dist.TCPStore(
                addr, port, world_size=world, is_master=False, timeout=timeout))
        else:
            store = dist.TCPStore(addr, port, world_size=world, timeout=timeout,
                                  is_master=env["RANK"] == "0")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    except (RuntimeError, OSError) as exc:  # DistStoreError is a RuntimeError
        raise PlannerError(
            "rendezvous", f"Rank {rank} could not meet the plan's other {world - 1} rank(s) "
            f"at {addr}:{port} within {timeout.total_seconds():g} s: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            ["start every node's script (`planner launch` wrote one per node)",
             f"check that every node reaches {addr}:{port} (firewall, --hosts addr)",
             "give slow starts more time with --timeout"]) from exc


def _job_attempt(env: dict[str, str], place: Any) -> int:
    """The job's restarts so far: every node's torchrun restart count, summed (one
    all-reduce). Node counts differ under the c10d rendezvous, where a node whose ranks
    were healthy restarts with the others without counting it; the sum grows with every
    failure the job survived, and every rank of an attempt agrees on it."""
    mine = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) if place.slot.local_rank == 0 else 0
    total = torch.tensor([mine], dtype=torch.int64, device=place.device)
    dist.all_reduce(total)
    return int(total.item())


def _prepare_run_dir(run_dir: Path, options: RunOptions, rank: int) -> None:
    if rank == 0:
        existing = checkpoint.complete_steps(run_dir)
        if existing and not options.resume:
            problem = [f"{run_dir} already holds checkpoints (up to step {existing[-1]})"]
        elif existing and existing[-1] >= options.steps:
            problem = [f"done: {run_dir} is at step {existing[-1]}, and --steps is "
                       f"{options.steps}"]
        else:
            problem = [None]
            (run_dir / "pids").mkdir(parents=True, exist_ok=True)
            (run_dir / STOPPED).unlink(missing_ok=True)  # an earlier run's stop
    else:
        problem = [None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None and problem[0].startswith("done: "):
        raise PlannerError("run-done", f"Nothing to resume: {problem[0][6:]}; the run and "
                           "its summary stay as they are.",
                           ["pass a larger --steps to train further"])
    if problem[0] is not None:
        raise PlannerError("run-exists", f"{problem[0]}; this run would start again from "
                           "step 0 and mix its checkpoints with theirs.",
                           ["pass --resume to continue that run",
                            "pass another --run-dir", "delete the folder"])
    (run_dir / "pids").mkdir(parents=True, exist_ok=True)
    (run_dir / "pids" / f"rank-{rank}.pid").write_text(f"{os.getpid()}\n")


def _train(options: RunOptions, plan: Any, layout: Any, place: Any, run_dir: Path,
           attempt: int, stop: StopRequest) -> dict[str, Any] | None:
    me, rank, device = place.slot, place.slot.rank, place.device
    check_checkpoints(plan.training.sync, options.checkpoint_every)
    _prepare_run_dir(run_dir, options, rank)
    notes = list(place.notes)
    started = time.perf_counter()
    info = inspect_model(plan)
    topo = topology(plan, layout, info)
    groups = build_groups(topo, rank, device.type)
    pipeline = plan.pipelines[me.pipeline]
    stage = pipeline.stages[me.stage]
    dtype = plan.training.dtype
    autocast = None
    if dtype in ("bf16", "fp16"):
        autocast = (device.type, torch.bfloat16 if dtype == "bf16" else torch.float16)
    if dtype == "tf32" and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    built = build_stage(info, stage, seed=options.seed, autocast=autocast)
    built.root.to(device)
    units = [u for chunk in built.units for u in chunk]
    if stage.tp > 1:
        notes += apply_tensor_parallel(units, groups.tp_mesh)
    for _, unit in units:
        apply_recompute(unit, stage.recompute)
    key = (me.pipeline, me.stage)
    replicas = topo.replicas_of(key)
    counts = {plan.pipelines[p].num_microbatches for p, _ in replicas}
    reshard = stage.zero == 3 and len(counts) == 1
    ignored = fsdp_ignored(topo, key, built.root)
    read = Counter(name for names in info.uses for name in names)  # (parallel.py: ZeRO)
    kept = sorted(name for name, param in built.root.named_parameters()
                  if reshard and read[name] > 1 and param not in ignored)
    ignored |= {built.root.get_parameter(name) for name in kept}
    managed: set[int] = set()
    followed = any(topo.following(k) for k in replicas)
    if stage.zero >= 1 and len(replicas) > 1 and followed:
        notes.append(f"pipeline {me.pipeline} stage {me.stage}: ZeRO-{stage.zero} shards "
                     "nothing: the stage (or a replica) is wider than its pipeline's "
                     "narrowest, and its followers do not run FSDP's gathers and "
                     "reductions yet, so its gradients are summed unsharded")
    elif stage.zero >= 1 and len(replicas) > 1:
        if stage.zero == 3 and not reshard:
            notes.append(f"pipeline {me.pipeline} stage {me.stage}: ZeRO-3 ran as ZeRO-2 "
                         f"(parameters gathered once per step): its replicas run "
                         f"{sorted(counts)} micro-batches, and FSDP's per-forward gathers "
                         "must match")
        apply_fsdp(built.chunks, groups.dp_mesh, reshard=reshard, ignored=ignored)
        managed = fsdp_managed(built.chunks, ignored)
        if kept:
            notes.append(f"pipeline {me.pipeline} stage {me.stage}: ZeRO-3 keeps "
                         f"{', '.join(kept)} unsharded: several of the stage's layers "
                         "read it, and a gather around one layer's forward would leave it "
                         "sharded for the other")
        if ignored and not managed:
            notes.append(f"pipeline {me.pipeline} stage {me.stage}: ZeRO-{stage.zero} shards "
                         "nothing: stages of other replica sets (another device type or "
                         "split) hold the same layers, so their gradients are summed unsharded")
    elif stage.zero >= 1:
        notes.append(f"pipeline {me.pipeline} stage {me.stage}: ZeRO-{stage.zero} has no "
                     "replica to shard with (one copy of these layers)")
    gradient_sum, averaging = _sums(plan, topo, groups, info, built, managed, rank, options)
    others = written_by_others(topo, key)
    params = list(dict.fromkeys(built.root.parameters()))
    opt_name = options.optimizer or ("sgd" if plan.training.optimizer.name == "sgd"
                                     else "adamw")
    optimizer = _optimizer(params, opt_name, options.lr)
    scale = (pipeline.micro_batch * loss_weight(plan, me.pipeline)
             * (FP16_SCALE if dtype == "fp16" else 1.0))
    loss_of = info.loaded.loss

    def loss_fn(output: torch.Tensor, target: Any) -> torch.Tensor:
        return loss_of(output, target) * scale

    batches = Batches(info.loaded, global_batch=plan.training.global_batch, seed=options.seed,
                      hook=options.data, vocab=info.vocab, classes=info.classes,
                      lengths=read_profile(options.lengths) if options.lengths else None)
    feed = packed_feed(plan, info, batches, built.chunks, pipeline=me.pipeline, rank=rank,
                       packing=options.packing, loss_scale=FP16_SCALE if dtype == "fp16" else 1,
                       following=any(topo.following((p.index, s.index))
                                     for p in plan.pipelines for s in p.stages))
    if feed is not None and averaging is not None:
        raise PlannerError(
            "unsupported-plan", f"training.sync {plan.training.sync.describe()} with samples "
            "of varying lengths: packed micro-batches weigh their losses over the global "
            "batch's targets, not over each pipeline's own share as the sync modes that "
            "change the optimization need.",
            ["run it with samples of one length", "or plan it with --sync every-step"])
    runner: PipelineRunner | Follower
    if groups.follows:
        runner = Follower(built.chunks[0], groups.following)
    else:
        runner = PipelineRunner(pipeline, stage, feed.chunks if feed else built.chunks,
                                device=device, group=groups.pp, chain=groups.chain,
                                loss_fn=feed.loss if feed else loss_fn,
                                following=groups.following)
    who = checkpoint.identity(info.module, plan.model.describe(), opt_name + (
        " with DiLoCo's outer optimizer" if plan.training.sync.mode == "diloco" else ""),
                              plan_json(plan))
    outer = averaging.outer_state() if averaging else None
    first = 0
    resumed = (checkpoint.resume(run_dir, built.root, optimizer, who, outer)
               if options.resume else None)
    if resumed is not None:
        first = resumed.step
        if rank == 0:
            for passed in resumed.passed_over:
                log(rank, f"warning: passed over checkpoint {passed}")
            log(rank, f"resumed from step {first} ({resumed.folder})"
                + ("" if resumed.verified else ", unverified: written before checksums")
                + (", written under another plan: resharded" if resumed.other_plan else ""))
    warning = checkpoint_warning(options.steps, options.checkpoint_every, first)
    if warning and rank == 0:
        log(rank, f"warning: {warning}")
    offset = sum(p.batch_share for p in plan.pipelines[:me.pipeline])
    share = pipeline.batch_share
    step_log = StepLog(run_dir, attempt, enabled=rank == 0, fresh=first == 0)
    reports_loss = runner.is_last and me.tp_rank == 0
    setup_seconds = time.perf_counter() - started
    if rank == 0:
        log(rank, f"{plan.model.describe()}: {len(plan.pipelines)} pipeline(s), "
            f"{layout.world_size} ranks, global batch {plan.training.global_batch}, "
            f"{dtype}; set up in {setup_seconds:.1f} s; steps {first + 1}-{options.steps}")
    step_seconds: list[float] = []
    busy_seconds: list[float] = []
    sync_timings: list[SyncTiming] = []
    losses: list[dict[str, Any]] = []
    named = list(built.root.named_parameters())
    loss_scale = FP16_SCALE if dtype == "fp16" else 1.0
    latest = first or None  # the latest checkpoint's step
    in_a_row = 0  # non-finite steps skipped in a row
    done, stopped = first, None
    for step in range(first, options.steps):
        begin = time.perf_counter()
        gradient_sum.start_step()
        inputs = targets = None
        if feed is not None:
            inputs, targets = feed.prepare(step, first=runner.is_first, last=runner.is_last,
                                           device=device)
        elif runner.is_first or runner.is_last:
            inputs, targets = batches.get(step, offset, offset + share)
            inputs = _to_device(inputs, device) if runner.is_first else None
            targets = _to_device(targets, device) if runner.is_last else None
        mb_losses = runner.step(inputs, targets)
        if feed is not None:
            feed.finish()
        schedule_end = time.perf_counter()
        busy = schedule_end - begin
        synced = gradient_sum(schedule_end)
        if dtype == "fp16":
            for p in params:
                if p.grad is not None:
                    p.grad.div_(FP16_SCALE)
        bad = bad_gradients(named)
        check = check_step(sum(float(x.detach()) for x in mb_losses)
                           * reported_loss(plan, me.pipeline) if reports_loss else 0.0,
                           not bad, stop.requested, device, loss_scale)
        # fp16's fixed loss scale overflows now and then: those steps are skipped, as
        # loss scaling does; any other NaN or inf is the guard's
        overflow = dtype == "fp16" and check.loss_finite and check.ranks_with_bad_grads > 0
        broken = not overflow and (not check.loss_finite or check.ranks_with_bad_grads > 0)
        in_a_row = in_a_row + 1 if broken else 0
        seconds = time.perf_counter() - begin
        if broken and (options.on_nonfinite == "stop" or in_a_row >= MAX_SKIPPED):
            culprits = gather_bad_ranks(
                BadRank(rank, me.pipeline, me.stage, tuple(bad)) if bad else None,
                layout.world_size) if check.ranks_with_bad_grads else []
            step_log.write(step + 1, check.loss if check.loss_finite else None, seconds,
                           skipped="non-finite: run stopped")
            raise nonfinite_error(step + 1, options.steps, check, culprits,
                                  skipped_in_a_row=in_a_row, latest_checkpoint=latest,
                                  lr=options.lr, data=options.data)
        if not (overflow or broken):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if averaging is not None and averaging.due(step + 1):
            synced = synced.then(averaging())
        seconds = time.perf_counter() - begin
        if step - first >= options.warmup:
            step_seconds.append(seconds)
            busy_seconds.append(busy)
            sync_timings.append(synced)
        loss = check.loss if check.loss_finite else None
        skipped = "overflow" if overflow else "non-finite" if broken else None
        losses.append({"step": step + 1, "loss": loss, "seconds": seconds}
                      | ({"skipped": skipped} if skipped else {}))
        step_log.write(step + 1, loss, seconds, skipped=skipped)
        if rank == 0:
            log(rank, f"step {step + 1}/{options.steps} loss {check.loss:.5f} {seconds:.3f} s "
                f"{plan.training.global_batch / seconds:.1f} samples/s"
                + (f" ({skipped}: step skipped)" if skipped else ""))
        done = step + 1
        if check.stop_requested and done < options.steps:
            stopped = f"stopped after step {done} of {options.steps} on request (SIGUSR1)"
            break
        if options.checkpoint_every and done % options.checkpoint_every == 0 and (
                done < options.steps or not options.final_checkpoint):
            _save(run_dir, done, built.root, optimizer, who, others, params, device, outer)
            latest = done
    if averaging is not None and done > first and not averaging.due(done):
        averaging()  # (the run ends on one model: `sync_modes.py`)
    if (options.final_checkpoint or stopped) and done > first:
        _save(run_dir, done, built.root, optimizer, who, others, params, device, outer)
    if stopped and rank == 0:
        log(rank, f"{stopped}; checkpoint {checkpoint.step_dir(run_dir, done)}")
        (run_dir / STOPPED).write_text(json.dumps({"step": done, "steps": options.steps,
                                                   "reason": stopped}) + "\n")
    return _summarize(options, plan, layout, place, run_dir, built, step_seconds,
                      busy_seconds, losses, first, notes, attempt, who, stopped, sync_timings)


def _sums(plan: Any, topo: Any, groups: Any, info: Any, built: Any, managed: set[int],
          rank: int, options: RunOptions) -> tuple[AfterBackward | Overlapped,
                                                   Averaging | None]:
    """The step's gradient sums (after the schedule, or started in backward where the
    plan overlaps them: `overlap.py`) and, in the sync modes that change the
    optimization, the holders' agreement every H steps (`sync_modes.py`). Every rank
    creates the groups of either alike."""
    sync, me = plan.training.sync, topo.layout.of(rank)
    every_step = GradientSum(built.root, topo, groups, rank, skip=managed)
    if sync.local:
        narrowed, local = within_pipelines(topo, groups, rank)
        weights = holder_weights(plan, topo, built.root, me.pipeline)
        return (AfterBackward(GradientSum(built.root, narrowed, local, rank, skip=managed)),
                Averaging(plan, every_step, built.root, weights, options.outer_lr,
                          options.outer_momentum))
    if not sync.overlap:
        return AfterBackward(every_step), None
    own = sync_groups(topo, rank)
    stage = plan.pipelines[me.pipeline].stages[me.stage]
    names = {id(param): name for name, param in built.root.named_parameters()}
    positions = {name: i for i, (name, _) in enumerate(info.module.named_parameters())}
    bucket_mb = sync.bucket_mb if options.bucket_mb is None else options.bucket_mb
    buckets = overlap_buckets(every_step, names, positions, own, int(bucket_mb * 2**20))
    expected = accumulations(info, stage, plan.pipelines[me.pipeline].num_microbatches)
    return Overlapped(every_step, buckets, names, expected), None


def _save(run_dir: Path, step: int, root: torch.nn.Module, optimizer: torch.optim.Optimizer,
          who: checkpoint.Identity, others: frozenset[str], params: list,
          device: torch.device, outer: dict | None) -> None:
    """A checkpoint, after every rank found its parameters finite (`guard.py`); `outer`:
    DiLoCo's outer state (`sync_modes.Averaging.outer_state`)."""
    check_parameters(params, step, device)
    checkpoint.save(run_dir, step, root, optimizer, who, others, outer)


def _summarize(options: RunOptions, plan: Any, layout: Any, place: Any, run_dir: Path,
               built: Any, step_seconds: list[float], busy_seconds: list[float],
               losses: list[dict], first: int, notes: list[str],
               attempt: int, who: checkpoint.Identity,
               stopped: str | None, sync_timings: list[SyncTiming]) -> dict[str, Any] | None:
    from planner.runtime.parallel import _local

    me, rank = place.slot, place.slot.rank
    memory, kind = peak_memory(place.device)
    held = list(dict.fromkeys(built.root.parameters()))
    mine = {"rank": rank, "node": me.node, "pipeline": me.pipeline, "stage": me.stage,
            "tp_rank": me.tp_rank, "device": str(place.device), "local_device": me.device,
            "params": sum(_local(p).numel() for p in held),
            "param_bytes": sum(_local(p).numel() * _local(p).element_size() for p in held),
            "peak_memory_bytes": memory, "memory_kind": kind,
            "step_time_mean": timing(step_seconds)["mean"] if step_seconds else None,
            "busy_mean": timing(busy_seconds)["mean"] if busy_seconds else None,
            **sync_means(sync_timings), "notes": notes}
    log(rank, f"pipeline {me.pipeline} stage {me.stage} tp {me.tp_rank} on {me.node}: "
        f"mean step {mine['step_time_mean'] or 0:.3f} s, peak memory "
        f"{memory / 2**20:.0f} MiB ({kind}), {mine['params']:,} parameters")
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None
    stats = timing(step_seconds)
    predicted = plan.prediction.step_time or None
    batch = plan.training.global_batch
    summary = {
        "plan": str(options.plan), "plan_fingerprint": who.plan,
        "model": plan.model.describe(), "model_fingerprint": who.model,
        "world_size": layout.world_size, "steps_run": len(losses), "first_step": first,
        "attempt": attempt, "global_batch": batch, "dtype": plan.training.dtype,
        "losses": losses, "step_time": stats, "warmup_steps": options.warmup,
        "samples_per_s": batch / stats["median"] if stats else None,
        "tokens_per_s": (batch * plan.training.seq_len / stats["median"]
                         if stats and plan.training.seq_len else None),
        "predicted_step_time": predicted,
        "prediction_error": ((stats["median"] - predicted) / predicted
                             if stats and predicted else None),
        "ranks": gathered,
        "notes": sorted({n for r in gathered for n in r["notes"]}),
        "skipped_steps": [row["step"] for row in losses if row.get("skipped")],
        "stopped": stopped,
        "gradient_sync": sync_summary(plan, gathered),
    }
    path = write_summary(run_dir, summary)
    log(rank, f"wrote {path}")
    return summary
