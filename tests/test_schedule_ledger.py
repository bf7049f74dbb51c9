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
WORKERS = 6


def _grab(path: str, worker: int, start, done) -> None:
    """Reserve two devices at a time, always the first free ones (so every worker
    wants the same devices at once), until none are left; report what was granted."""
    ledger = Ledger(Path(path))
    granted = []
    start.wait()  # (all at once)
    for attempt in range(200):
        held = ledger.held("lab")
        free = [(n, d) for n in NODES for d in range(PER_NODE) if d not in held.get(n, set())]
        if len(free) < 2:
            break
        devices: dict[str, list[int]] = {}
        for node, index in free[:2]:
            devices.setdefault(node, []).append(index)
        try:
            [reservation] = ledger.reserve("lab", [(f"w{worker}-{attempt}", devices)],
                                           owner=f"worker {worker}")
        except PlannerError as exc:
            assert exc.kind == "reserved"
            continue
        granted.append([(n, d) for n, ds in reservation.devices for d in ds])
    done.put((worker, granted))


def test_processes_reserving_at_once_never_double_book(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path)  # (created once, before the race)
    context = multiprocessing.get_context("spawn")
    done, start = context.Queue(), context.Barrier(WORKERS)
    workers = [context.Process(target=_grab, args=(str(path), w, start, done))
               for w in range(WORKERS)]
    for worker in workers:
        worker.start()
    results = dict(done.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
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
