"""The reservations ledger: planners running at once never double-book a device."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from planner.errors import PlannerError
from planner.schedule.ledger import Ledger

NODES = ("a100-0", "a100-1", "v100-0", "v100-1")
PER_NODE = 8
WORKERS = 8


ROUNDS = len(NODES) * PER_NODE  # a device a round: every device once


def _grab(path: str, worker: int, step, done) -> None:
    """Round after round, in lockstep with the other workers: read which devices are
    free, wait until every worker has read the same, then ask for the first free one,
    as they all do at that moment. Reports, per round, the devices it was granted
    (empty: refused as reserved), or the error it met (and the other workers are
    released from waiting on it)."""
    try:
        done.put((worker, _rounds(Ledger(Path(path)), worker, step)))
    except Exception as exc:  # (reported to the test, which fails on it)
        step.abort()
        done.put((worker, repr(exc)))


def _rounds(ledger: Ledger, worker: int, step) -> list[list[tuple[str, int]]]:
    granted: list[list[tuple[str, int]]] = []
    for round_number in range(ROUNDS):
        step.wait()  # (the last round's reservations are all made)
        held = ledger.held("lab")
        free = [(n, d) for n in NODES for d in range(PER_NODE) if d not in held.get(n, set())]
        node, index = free[0]
        step.wait()  # (everyone has read: all ask for the same devices at once)
        try:
            [reservation] = ledger.reserve("lab", [(f"w{worker}-{round_number}",
                                                    {node: [index]})], owner=f"worker {worker}")
        except PlannerError as exc:
            if exc.kind != "reserved":
                raise
            granted.append([])
            continue
        granted.append([(n, d) for n, ds in reservation.devices for d in ds])
    return granted


def test_processes_reserving_at_once_never_double_book(tmp_path):
    """Several processes ask for the same device at the same moment, round after
    round: in each round exactly one of them gets it, the others are refused, and at
    the end every device was granted once and is stored once. With its unique index
    dropped, a ledger that trusts the caller's read of the free devices fails this in
    every run; one that checks in a transaction of its own before writing (a narrow
    race) only in runs where two processes interleave just there, about one in four
    on two cores."""
    path = tmp_path / "ledger.sqlite"
    Ledger(path)  # (created once, before the race)
    context = multiprocessing.get_context("spawn")
    done, step = context.Queue(), context.Barrier(WORKERS, timeout=120)
    workers = [context.Process(target=_grab, args=(str(path), w, step, done))
               for w in range(WORKERS)]
    for worker in workers:
        worker.start()
    results = dict(done.get(timeout=300) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
    errors = {w: r for w, r in results.items() if isinstance(r, str)}
    assert not errors
    for round_number in range(ROUNDS):
        winners = [w for w, grants in results.items() if grants[round_number]]
        assert len(winners) == 1, f"round {round_number}: granted to workers {winners}"
    granted = [device for grants in results.values() for grant in grants for device in grant]
    assert len(granted) == len(set(granted)) == len(NODES) * PER_NODE  # each once, all used
    stored = [(n, d) for r in Ledger(path).reservations("lab") for n, ds in r.devices
              for d in ds]
    assert sorted(stored) == sorted(granted)


def test_a_reserved_device_is_refused_until_cancelled(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    [first] = ledger.reserve("lab", [("a", {"n0": [0, 1]})], owner="me")
    with pytest.raises(PlannerError, match=r"Device 1 of node n0 .* reserved for job a; job b"):
        ledger.reserve("lab", [("b", {"n0": [1, 2]})], owner="you")
    assert ledger.held("lab") == {"n0": {0, 1}}  # all or nothing: b got no device
    assert ledger.held("other") == {}  # (another cluster's devices are its own)
    with pytest.raises(PlannerError, match="already reserved by this request"):
        ledger.reserve("lab", [("c", {"n1": [0]}), ("d", {"n1": [0]})], owner="me")
    ledger.cancel(first.id)
    [second] = ledger.reserve("lab", [("b", {"n0": [1, 2]})], owner="you")
    assert ledger.held("lab") == {"n0": {1, 2}}
    assert [r.job for r in ledger.reservations("lab")] == ["b"]
    everything = ledger.reservations("lab", ended=True)
    assert [(r.job, r.cancelled is not None) for r in everything] == [("a", True), ("b", False)]
    assert everything[0].devices == (("n0", (0, 1)),)  # what it held, still listed
    with pytest.raises(PlannerError, match="no reservation 99"):
        ledger.cancel(99)
    assert second.id != first.id


def test_a_reservation_with_an_end_frees_its_devices_then(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    ledger.reserve("lab", [("old", {"n0": [0]})], owner="me", until=time.time() - 1)
    assert ledger.held("lab") == {}
    ledger.reserve("lab", [("new", {"n0": [0]})], owner="me")
    assert ledger.held("lab") == {"n0": {0}}
