"""Per-step logs, per-rank figures and the run summary (JSON, schema_version 1).

RUN_DIR/losses.jsonl: one line per step as it finishes (rank 0):
    {"step": 3, "loss": 6.21, "seconds": 0.84, "attempt": 0}
`attempt` counts the job's restarts (torchrun's, summed over nodes), so a resumed run's
lines follow the interrupted one's; for each step the last line is the one that counts.
A step whose update was skipped says why ("skipped": "overflow" for fp16's loss scale,
"non-finite" for a NaN or inf loss or gradient, with "loss": null where the loss was
not finite). A run that starts at step 0 (no checkpoint to resume from) starts the file
afresh.

RUN_DIR/summary.json (rank 0, at the end):
    kind "run-summary", plan, plan_fingerprint and model_fingerprint (what the
    checkpoints' manifests record), world_size, steps_run, first_step (0, or the step
    resumed from), losses [{step, loss, seconds}], skipped_steps, stopped (why the run
    ended before its last step, on a stop request; else null), step_time {mean, median, min,
    max} over the timed steps (after `warmup` steps), samples_per_s,
    tokens_per_s, predicted_step_time (the plan's), prediction_error
    ((measured - predicted) / predicted), ranks [{rank, node, pipeline, stage,
    tp_rank, device, params, param_bytes, peak_memory_bytes, memory_kind,
    step_time_mean, busy_mean, sync_exposed_mean, sync_in_flight_mean, sync_sums,
    sync_started_in_backward}], notes,
    gradient_sync {mode, interval, overlap, exposed, in_flight, predicted_exposed,
    predicted_whole}.

Gradient sync, measured on each rank per timed step (`overlap.SyncTiming`): exposed, from
the end of its schedule's last backward until its sums were done (what the step waits
for); in flight, how long any of its sums was under way, hidden behind backward or not;
their means per rank, and in `gradient_sync` the largest of any rank beside the plan's
prediction of the step's exposed sync (`prediction.dp_comm`) and of one whole sync
(`prediction.whole_sync`). Per rank also its all-reduces of the last timed step
(sync_sums) and how many of them started within backward (sync_started_in_backward).

Memory: CUDA's peak allocated bytes on GPUs; on the CPU the process's peak
resident set (torch itself included, so it overstates what the stage needs).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

SCHEMA_VERSION = 1


def log(rank: int, message: str) -> None:
    print(f"[planner rank {rank}] {message}", file=sys.stderr, flush=True)


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    # ru_maxrss is KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale), "cpu peak RSS"


class StepLog:
    """Rank 0's per-step log file."""

    def __init__(self, run_dir: Path, attempt: int, enabled: bool, fresh: bool) -> None:
        """fresh: the run starts at step 0 (no checkpoint loaded): earlier lines go."""
        self.path = run_dir / "losses.jsonl"
        self.attempt, self.enabled = attempt, enabled
        if enabled and fresh and self.path.exists():
            self.path.unlink()

    def write(self, step: int, loss: float | None, seconds: float,
              skipped: str | None = None) -> None:
        """loss: None where it was not finite (JSON has no NaN)."""
        if not self.enabled:
            return
        row = {"step": step, "loss": loss, "seconds": seconds, "attempt": self.attempt,
               "time": time.time()} | ({"skipped": skipped} if skipped else {})
        with self.path.open("a") as out:
            out.write(json.dumps(row) + "\n")


def read_losses(run_dir: Path) -> dict[int, float | None]:
    """Each step's loss from losses.jsonl (the last line of a step wins; None where it was
    not finite)."""
    out: dict[int, float | None] = {}
    path = run_dir / "losses.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                out[row["step"]] = row["loss"]
    return out


def timing(seconds: list[float]) -> dict[str, float] | None:
    if not seconds:
        return None
    return {"mean": statistics.fmean(seconds), "median": statistics.median(seconds),
            "min": min(seconds), "max": max(seconds), "count": len(seconds)}


def sync_means(timings: list[Any]) -> dict[str, float | None]:
    """A rank's mean exposed and in-flight sync over its timed steps (`SyncTiming`s)."""
    if not timings:
        return {"sync_exposed_mean": None, "sync_in_flight_mean": None}
    return {"sync_exposed_mean": statistics.fmean(t.exposed for t in timings),
            "sync_in_flight_mean": statistics.fmean(t.in_flight for t in timings),
            "sync_sums": timings[-1].sums,
            "sync_started_in_backward": timings[-1].started_in_backward}


def sync_summary(plan: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's gradient sync: the plan's mode, measured (the largest mean of any rank)
    beside predicted."""
    sync, prediction = plan.training.sync, plan.prediction

    def most(key: str) -> float | None:
        values = [r[key] for r in ranks if r.get(key) is not None]
        return max(values) if values else None

    return {"mode": sync.mode, "interval": sync.interval, "overlap": sync.overlap,
            "exposed": most("sync_exposed_mean"), "in_flight": most("sync_in_flight_mean"),
            "predicted_exposed": prediction.dp_comm or None,
            "predicted_whole": (prediction.dp_comm if prediction.whole_sync is None
                                else prediction.whole_sync) or None}


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = run_dir / "summary.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"kind": "run-summary", "schema_version": SCHEMA_VERSION,
                               **summary}, indent=1) + "\n")
    tmp.replace(path)
    return path
