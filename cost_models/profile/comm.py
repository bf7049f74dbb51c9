"""Collective and point-to-point communication among N local processes.

The processes are spawned with torch.multiprocessing and joined with
torch.distributed over TCP on localhost: gloo on CPU tensors, nccl with one GPU
per process. For each message size, after warm-up calls, each operation is timed
call by call on rank 0 for a time budget (at least `_MIN_CALLS` calls; rank 0 says
when to stop, see `_mean_seconds`) and the mean kept: a training step pays the mean,
and on a shared machine the per-call time is bimodal (a scheduler tick decides the
mode), so a median of a few calls jumps between modes while the mean over many is
stable. Figures follow
nccl-tests: algbw = bytes / seconds; busbw = algbw × 2(n-1)/n for all_reduce
(bytes = the buffer), algbw × (n-1)/n for all_gather (bytes = the whole output),
and algbw for p2p, whose time is half a send/recv ping-pong between ranks 0 and 1.

Each operation also gets an alpha-beta fit, seconds = alpha + bytes / beta_bandwidth
(alpha: latency; beta_bandwidth in algbw terms, so bus bandwidth = beta_bandwidth ×
bus_factor): the bandwidth from the two largest messages, alpha from the smallest
(`fit_alpha_beta`).

Last, the workers measure how computing and an all-reduce in flight slow each other
(`contention`: a CPU worker on a core of its own first), which an overlapped sync pays.
"""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cost_models.profile.contention import measure_contention, pin_to_own_cores
from cost_models.profile.timing import Clock
from planner.errors import PlannerError

_SIZES = {True: tuple(2**i for i in range(10, 27, 4)),  # 1 KiB .. 64 MiB, 16x apart
          False: tuple(2**i for i in range(10, 29, 2))}  # 1 KiB .. 256 MiB, 4x apart
_BUDGET_S = {True: 0.1, False: 1.0}  # seconds of timed calls per operation and size
_MIN_CALLS = 3
_ROUNDS = 4  # the budget's calls come in about this many rounds (see `_mean_seconds`)
_WARM_UP_CALLS = 2
_OP_TIMEOUT = {True: 60, False: 300}  # seconds one collective may wait for the others
_DEADLINE = {True: 300, False: 1800}  # seconds for the whole measurement
OPERATIONS = ("all_reduce", "all_gather", "p2p")
# newer torch deprecates all_gather_into_tensor in favour of all_gather_single
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def bus_factor(operation: str, world: int) -> float:
    return {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world,
            "p2p": 1.0}[operation]


def measure_comm(*, processes: int, device: str, quick: bool) -> dict:
    """Spawn `processes` processes on `device` ("cpu": gloo; "cuda": nccl, one GPU
    each) and time every operation over the mode's message sizes."""
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="planner-comm-") as tmp:
        out = Path(tmp) / "seconds.json"
        context = mp.start_processes(
            _worker, args=(processes, f"tcp://127.0.0.1:{_free_port()}", backend, quick,
                           str(out)),
            nprocs=processes, join=False, start_method="spawn")
        _join(context, _DEADLINE[quick], backend)
        seconds = json.loads(out.read_text())
    return summarize(seconds, backend=backend, world=processes, device=device)


def summarize(seconds: dict, *, backend: str, world: int, device: str) -> dict:
    """The profile's `communication` from the workers' measurements: per operation,
    [message size, mean seconds of a call] for each size (p2p: a whole ping-pong), and
    where measured, how computing and an all-reduce slow each other (`contention`)."""
    summary = {"backend": backend, "world_size": world, "device": device,
               "collectives": {op: _summary(op, seconds[op], world) for op in OPERATIONS}}
    if "contention" in seconds:
        summary["contention"] = seconds["contention"]
    return summary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join(context: mp.ProcessContext, deadline_s: float, backend: str) -> None:
    """Wait for the workers; a failure or the deadline ends all of them."""
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise PlannerError("comm-failed", f"The {backend} communication benchmark "
                                   f"did not finish within {deadline_s} s; it was stopped.",
                                   ["run again with --no-comm to skip it"])
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        remedies = ["run again with --no-comm to skip it"]
        if backend == "gloo":
            remedies.insert(0, "if gloo picked the wrong network interface, set "
                            "GLOO_SOCKET_IFNAME=lo")
        raise PlannerError("comm-failed", f"The {backend} communication benchmark failed: "
                           f"{lines[-1] if lines else exc}", remedies) from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)


def _worker(rank: int, world: int, init_method: str, backend: str, quick: bool,
            out: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=_OP_TIMEOUT[quick]),
                            device_id=device if device.type == "cuda" else None)
    try:
        clock = Clock(device)
        seconds: dict = {op: [[size, _mean_seconds(_operation(op, size, rank, world, device),
                                                   clock, _BUDGET_S[quick], device)]
                              for size in _SIZES[quick]]
                         for op in OPERATIONS}
        if device.type == "cpu":
            pin_to_own_cores(rank, world)
        seconds["contention"] = measure_contention(
            device, clock, lambda fn: _mean_seconds(fn, clock, _BUDGET_S[quick], device),
            _BUDGET_S[quick])
        if rank == 0:
            Path(out).write_text(json.dumps(seconds))
    finally:
        dist.destroy_process_group()


def _operation(op: str, size: int, rank: int, world: int,
               device: torch.device) -> Callable[[], object]:
    """A call doing `op` on about `size` bytes of fp32 (all_gather: the whole output)."""
    buffer = torch.zeros(size // 4, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buffer)
    if op == "all_gather":
        part = torch.zeros(size // 4 // world, device=device)
        whole = torch.empty(part.numel() * world, device=device)
        return lambda: _gather_into(whole, part)
    peer = 1 - rank
    if rank == 0:
        return lambda: (dist.send(buffer, peer), dist.recv(buffer, peer))
    if rank == 1:
        return lambda: (dist.recv(buffer, peer), dist.send(buffer, peer))
    return lambda: None  # ranks past 1 sit the ping-pong out


def _mean_seconds(fn: Callable[[], object], clock: Clock, budget_s: float,
                  device: torch.device) -> float:
    """Mean seconds per call of `fn`, timed call by call for about `budget_s` seconds
    of rank 0's time. After a pilot of `_MIN_CALLS` calls the calls come in rounds,
    each sized from rank 0's pilot to take 1/`_ROUNDS` of the budget, and before each
    round rank 0 says whether to go on: every rank makes the same calls (ranks past 1
    sit the ping-pong out and would judge otherwise), and a machine that gets busy
    midway stops near the budget, not after the many calls a fast pilot promised
    (a fixed count from the pilot once took minutes on a loaded machine)."""
    for _ in range(_WARM_UP_CALLS):
        fn()
    clock.sync()
    dist.barrier()
    deadline = clock.timer() + budget_s  # rank 0's is the one that counts
    samples = []

    def timed(calls: int) -> None:
        for _ in range(calls):
            start = clock.mark()
            fn()
            samples.append(clock.seconds(start, clock.mark()))

    timed(_MIN_CALLS)
    per_round = torch.tensor([budget_s / _ROUNDS * len(samples) / max(sum(samples), 1e-9)],
                             device=device)
    dist.broadcast(per_round, 0)
    while True:
        go_on = torch.tensor([float(clock.timer() < deadline)], device=device)
        dist.broadcast(go_on, 0)
        if not go_on.item():
            return statistics.fmean(samples)
        timed(max(1, int(per_round.item())))


def _summary(op: str, measured: list[list[float]], world: int) -> dict:
    factor = bus_factor(op, world)
    sweep = []
    for size, seconds in measured:
        nbytes = size // 4 // world * world * 4 if op == "all_gather" else size
        seconds = seconds / 2 if op == "p2p" else seconds  # one way of the ping-pong
        sweep.append({"bytes": nbytes, "seconds": seconds, "algbw": nbytes / seconds,
                      "busbw": nbytes / seconds * factor})
    alpha, bandwidth = fit_alpha_beta([(p["bytes"], p["seconds"]) for p in sweep])
    return {"alpha": alpha, "beta_bandwidth": bandwidth, "bus_factor": factor, "sweep": sweep}


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha, bandwidth) with seconds ≈ alpha + bytes / bandwidth: the bandwidth from the
    two largest messages (the slope between them, in which latency cancels: the rate a
    gradient sync's megabytes move at), alpha what the smallest message takes beyond its
    bytes at that bandwidth (0 at least). A least-squares line through every size let the
    small messages move the slope (their times are scheduler ticks, and on a rate-capped
    link a token bucket's burst carries them above the rate): over loopback capped at 300
    Mbit/s, whose 4 and 64 MiB all-reduces ran at 150 Mb/s of bus bandwidth, it gave 166
    to 211 Mb/s from run to run, and priced a sync that fast. If time does not grow with
    size, the bandwidth is the best measured one."""
    ordered = sorted(points)
    (smallest, its_seconds), (below, below_seconds), (largest, largest_seconds) = (
        ordered[0], ordered[-2] if len(ordered) > 1 else ordered[0], ordered[-1])
    slope = ((largest_seconds - below_seconds) / (largest - below)
             if largest > below else 0.0)
    bandwidth = 1 / slope if slope > 0 else max(x / y for x, y in points)
    return max(0.0, its_seconds - smallest / bandwidth), bandwidth
