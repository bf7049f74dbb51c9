"""Measure the machine this runs on: a device profile (JSON, schema_version 1).

    doc = run_profile(quick=True, model="gpt2-small", seq_len=None, dtype="fp32",
                      processes=2, devices="all", progress=None)
    doc = load_profile("profile.json")  # validated; PlannerError names file and field
    noise_warnings(doc)  # measurements whose samples disagree (cost_models.profile.noise)

Parts: `device` (what each device is, matmul FLOP/s per dtype, memory bandwidth),
`layers` (each traced layer's forward and backward seconds in real training steps),
`comm` (collectives and point-to-point among local processes), `timing` (samples
and their spread), `noise` (warnings from the spread), `schema` (the document and
its validation).
"""

from __future__ import annotations

import json
import os
import platform
import socket
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from cost_models.profile.comm import measure_comm
from cost_models.profile.device import describe, matmul_dtypes, measure_bandwidth, measure_matmul
from cost_models.profile.layers import micro_batches, profile_layers
from cost_models.profile.noise import noise_warnings
from cost_models.profile.schema import KIND, SCHEMA_VERSION, validate
from cost_models.profile.timing import Sampler, sample_seconds
from planner import __version__
from planner.dtypes import canonical_dtype
from planner.errors import PlannerError
from planner.models import load_model, model_spec

__all__ = ["load_profile", "noise_warnings", "run_profile"]

Progress = Callable[[str, int, int], None]  # (stage starting, stages done, stages in all)


def run_profile(*, quick: bool, model: str | None = None, seq_len: int | None = None,
                dtype: str = "fp32", processes: int = 2, devices: str = "all",
                comm: bool = True, progress: Progress | None = None,
                sample: Sampler = sample_seconds) -> dict:
    """Profile the CPU and (devices "cuda" or "all") each CUDA device, and with `comm`
    the communication among `processes` local processes (nccl when there are that
    many GPUs and `devices` is not "cpu", else gloo on the CPU). With `model`, time
    its layers in `dtype` on each device. `progress` hears of each stage as it starts;
    `sample` times the matmuls and copies (tests give a fake)."""
    dtype = canonical_dtype(dtype)
    if seq_len is not None and model is None:
        raise PlannerError("bad-option", "--seq-len is the sequence length of --model; "
                           "pass a model too.")
    if model is not None:  # a bad name or shape fails now, not after the sweeps
        load_model(model_spec(model), seq_len=seq_len)
    selected = _devices(devices)
    comm_device = _comm_device(devices, processes) if comm else None
    stages = sum(len(matmul_dtypes(d)) + 1 for d in selected)
    stages += (1 + len(micro_batches(quick))) * len(selected) if model else 0
    tick = _Ticker(stages + (1 if comm else 0), progress)
    doc: dict = {"schema_version": SCHEMA_VERSION, "kind": KIND, "host": socket.gethostname(),
                 "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "software": {"python": platform.python_version(), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "planner": __version__,
                              "platform": platform.platform()},
                 "mode": "quick" if quick else "full",
                 # a machine busy with other work measures slow: its 1/5/15-minute load
                 "load_average": list(os.getloadavg()),
                 "devices": [], "communication": None}
    for device in selected:
        entry = describe(device)
        entry["matmul"] = {}
        for name in matmul_dtypes(device):
            tick(f"{device}: {name} matmul")
            entry["matmul"][name] = measure_matmul(device, name, quick, sample)
        tick(f"{device}: memory bandwidth")
        entry["memory_bandwidth"] = measure_bandwidth(device, entry["memory_bytes"], quick,
                                                      sample)
        entry["layers"] = profile_layers(model, seq_len=seq_len, dtype=dtype, device=device,
                                         quick=quick, tick=tick) if model else None
        doc["devices"].append(entry)
    if comm_device is not None:
        tick(f"communication: {processes} processes on {comm_device}")
        doc["communication"] = measure_comm(processes=processes, device=comm_device,
                                            quick=quick)
    return doc


def load_profile(path: str | Path) -> dict:
    """Read and validate a device profile written by `planner profile`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlannerError("bad-profile", f"Cannot read the profile {path}: "
                           f"{exc.strerror or exc}.") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError("bad-profile", f"{path}: not JSON ({exc.msg} at line {exc.lineno}, "
                           f"column {exc.colno}).",
                           ["a profile is the file `planner profile -o FILE` writes"]) from None
    return validate(doc, str(path))


class _Ticker:
    """Reports each stage to `progress` as it starts, with the count done so far."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.done, self.progress = total, 0, progress

    def __call__(self, label: str) -> None:
        if self.progress is not None:
            self.progress(label, self.done, self.total)
        self.done += 1


def _devices(selection: str) -> list[torch.device]:
    gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if selection not in ("cpu", "cuda", "all"):
        raise PlannerError("bad-value", f"--devices must be cpu, cuda or all (got "
                           f"{selection!r}).")
    if selection == "cuda" and not gpus:
        raise PlannerError("no-cuda", "--devices cuda: this machine has no CUDA device.",
                           ["pass --devices cpu"])
    return {"cpu": [torch.device("cpu")], "cuda": gpus,
            "all": [torch.device("cpu"), *gpus]}[selection]


MAX_PROCESSES = 16  # local processes of the communication benchmark (or one per GPU)


def _comm_device(selection: str, processes: int) -> str:
    """"cuda" (nccl) when each process can have its own GPU, else "cpu" (gloo)."""
    if processes < 2:
        raise PlannerError("bad-value", f"--processes must be at least 2 to measure "
                           f"communication (got {processes}).", ["pass --no-comm to skip it"])
    most = max(MAX_PROCESSES, torch.cuda.device_count())
    if processes > most:  # (1,000 CPU processes ran for minutes without an end)
        raise PlannerError("bad-value", f"--processes must be at most {most} (got "
                           f"{processes}): one process per device of a node is what a plan "
                           "runs.", [f"pass --processes {min(8, most)}"])
    gpus = torch.cuda.device_count()
    if selection != "cpu" and gpus >= processes:
        return "cuda"
    if selection == "cuda":
        raise PlannerError("bad-value", f"--processes {processes} with --devices cuda needs "
                           f"{processes} CUDA devices; this machine has {gpus}.",
                           ["pass fewer --processes", "pass --no-comm to skip communication"])
    return "cpu"
