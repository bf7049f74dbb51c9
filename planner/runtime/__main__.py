"""`python -m planner.runtime --plan plan.json [options]`: what every rank runs.

Started by torchrun (the scripts `planner launch` writes), which sets RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and
MASTER_PORT. A PlannerError (a plan/environment mismatch, a bad option, a NaN
loss) prints one paragraph and exits with 1; `--debug` shows the traceback instead.
SIGUSR1 ends the run after the step in progress, with a checkpoint (`guard.py`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from planner.errors import PlannerError

if TYPE_CHECKING:
    from planner.runtime.train import RunOptions


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m planner.runtime",
        description="Train with a plan on torch.distributed (run by torchrun on every rank).")
    p.add_argument("--plan", type=Path, required=True, help="The plan file (planner solve -o).")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="Checkpoints, logs and the summary (default: runs/<plan name>); "
                   "shared by all nodes.")
    p.add_argument("--steps", type=int, default=10, help="Optimizer steps in all.")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="Save a checkpoint every K steps (0: only at the end).")
    p.add_argument("--no-final-checkpoint", action="store_true",
                   help="Do not save a checkpoint after the last step.")
    p.add_argument("--resume", action="store_true",
                   help="Continue from the latest complete checkpoint in --run-dir, if any.")
    p.add_argument("--data", default=None, metavar="MODULE:FUNCTION",
                   help="A data hook (default: synthetic data); see planner/runtime/data.py.")
    p.add_argument("--lengths", type=Path, default=None, metavar="PROFILE",
                   help="Synthetic samples of variable length, drawn from this data profile "
                   "(planner data-profile -o), packed into micro-batches.")
    p.add_argument("--packing", choices=("balanced", "naive"), default="balanced",
                   help="Variable-length samples (--lengths, or a data hook returning lists): "
                   "balanced (each pipeline's work matches its speed, micro-batches of "
                   "equal work) or naive (in order, the plan's shares).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the weights and the data.")
    p.add_argument("--lr", type=float, default=1e-3, help="Learning rate.")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=None,
                   help="Default: the plan's (adam runs as AdamW without weight decay).")
    p.add_argument("--cpu", action="store_true",
                   help="Run every rank on the CPU with gloo, whatever devices the plan names.")
    p.add_argument("--ignore-device-type", action="store_true",
                   help="Run even if a GPU's name does not match the plan's device type.")
    p.add_argument("--warmup", type=int, default=1,
                   help="Steps left out of the step-time statistics.")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="Seconds a collective may wait before the run fails.")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="A step with a NaN or infinite loss or gradient: stop the run before "
                   "applying it (default), or skip its update (the run still stops when several "
                   "such steps come in a row). Either way no checkpoint holds a NaN.")
    p.add_argument("--bucket-mb", type=float, default=None, metavar="MB",
                   help="Where the plan's gradient sync overlaps backward: the most MiB of "
                   "gradients one all-reduce sums (DDP's bucket_cap_mb; default: the plan's "
                   "training.sync.bucket_mb, which its prediction priced).")
    p.add_argument("--outer-lr", type=float, default=0.7,
                   help="DiLoCo (the plan's sync diloco:H): the outer optimizer's learning "
                   "rate on the pseudo-gradients.")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="DiLoCo: the outer optimizer's Nesterov momentum.")
    p.add_argument("--debug", action="store_true", help="Show tracebacks of errors.")
    return p


def options_from(args: argparse.Namespace) -> RunOptions:
    """The run options the parsed arguments give."""
    from planner.runtime.train import RunOptions

    return RunOptions(
        plan=args.plan, run_dir=args.run_dir, steps=args.steps,
        checkpoint_every=args.checkpoint_every, final_checkpoint=not args.no_final_checkpoint,
        resume=args.resume, data=args.data, lengths=args.lengths, packing=args.packing,
        seed=args.seed, lr=args.lr,
        optimizer=args.optimizer, cpu=args.cpu, check_device_type=not args.ignore_device_type,
        warmup=args.warmup, timeout=args.timeout, on_nonfinite=args.on_nonfinite,
        bucket_mb=args.bucket_mb, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from planner.runtime.train import run

    try:
        run(options_from(args))
    except PlannerError as exc:
        if args.debug:
            raise
        print(exc.report(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
