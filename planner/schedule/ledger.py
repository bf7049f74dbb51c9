"""Reservations of devices, kept in SQLite (the standard library's sqlite3), so that
planners running at once never double-book a device.

Every change runs in one `BEGIN IMMEDIATE` transaction, which takes the database's
write lock before it reads: a reservation checks that its devices are free and records
them with no other writer in between (a second planner waits for the lock, up to
`LOCK_WAIT` seconds, and then sees the first one's devices). A unique index on
(cluster, node, device) over the devices held now backs this up: the database itself
refuses a device held twice.

Reservations are keyed by the cluster's name. One that has an end (`until`, seconds
since the epoch) stops holding its devices then; `cancel` ends one now.

Where: $PLANNER_LEDGER, else $XDG_DATA_HOME/planner/ledger.sqlite, else
~/.local/share/planner/ledger.sqlite.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from planner.errors import PlannerError

LOCK_WAIT = 30.0  # seconds a writer waits for another's transaction to end
RETRIES = 3  # plans tried again (schedule, solve) when another planner reserves meanwhile

_SCHEMA = """
CREATE TABLE IF NOT EXISTS reservations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    cluster TEXT NOT NULL,
    job TEXT NOT NULL,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    until REAL,
    cancelled REAL
);
CREATE TABLE IF NOT EXISTS held (
    reservation INTEGER NOT NULL REFERENCES reservations(id),
    cluster TEXT NOT NULL,
    node TEXT NOT NULL,
    device INTEGER NOT NULL,
    active INTEGER NOT NULL DEFAULT 1
);
CREATE UNIQUE INDEX IF NOT EXISTS one_holder ON held(cluster, node, device) WHERE active = 1;
"""


@dataclass(frozen=True, kw_only=True)
class Reservation:
    id: int
    cluster: str
    job: str
    owner: str
    created: float
    until: float | None
    cancelled: float | None
    devices: tuple[tuple[str, tuple[int, ...]], ...]  # (node, device indices)

    def active(self, now: float) -> bool:
        return self.cancelled is None and (self.until is None or self.until > now)


def default_path() -> Path:
    if os.environ.get("PLANNER_LEDGER"):
        return Path(os.environ["PLANNER_LEDGER"])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "planner" / "ledger.sqlite"


class Machine(Protocol):
    """A node of a cluster spec or a scheduler's machine: a name, and devices 0..n-1."""

    name: str
    devices: int


def free_devices(machines: Iterable[Machine], held: Mapping[str, set[int]]
                 ) -> dict[str, tuple[int, ...]]:
    """Each machine's (a pool's machines, a cluster's nodes) devices that no reservation
    holds."""
    return {m.name: tuple(i for i in range(m.devices) if i not in held.get(m.name, set()))
            for m in machines}


def open_ledger(path: Path | None, *, create: bool) -> Ledger | None:
    """The ledger at `path` (default: `default_path`), or None where it does not exist
    and `create` is not asked: a planner that reserves nothing leaves no file behind."""
    path = path or default_path()
    return Ledger(path) if create or path.exists() else None


class Ledger:
    """The reservations in one SQLite file (created on first use)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with closing(self._connect()) as db:
                db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise PlannerError("ledger", f"Cannot open the reservations ledger "
                               f"{str(self.path)!r}: {exc}.",
                               ["set PLANNER_LEDGER to a file you can write"]) from None

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=LOCK_WAIT, isolation_level=None)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One BEGIN IMMEDIATE transaction: committed if the block ends normally, else
        rolled back; ended reservations' devices are released first."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")  # (the write lock, before anything is read)
            try:
                db.execute("UPDATE held SET active = 0 WHERE active = 1 AND reservation IN "
                           "(SELECT id FROM reservations WHERE cancelled IS NOT NULL OR "
                           "(until IS NOT NULL AND until <= ?))", (time.time(),))
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def held(self, cluster: str) -> dict[str, set[int]]:
        """The devices active reservations hold on `cluster`, by node."""
        with self._transaction() as db:
            return _held(db, cluster)

    def reserve(self, cluster: str, requests: Sequence[tuple[str, Mapping[str, Sequence[int]]]],
                *, owner: str, until: float | None = None) -> list[Reservation]:
        """Reserve, all or nothing, each `(job, {node: device indices})`; an error naming
        the first device another reservation holds (then nothing is reserved)."""
        with self._transaction() as db:
            now = time.time()  # (under the lock: creation times follow the commit order)
            held = _held(db, cluster)
            wanted: set[tuple[str, int]] = set()
            for job, devices in requests:
                for node, indices in devices.items():
                    for index in indices:
                        if index in held.get(node, set()) or (node, index) in wanted:
                            holder = _holder(db, cluster, node, index)
                            raise PlannerError(
                                "reserved", f"Device {index} of node {node} (cluster "
                                f"{cluster}) is already reserved"
                                + (f" for job {holder}" if holder else " by this request")
                                + f"; job {job} cannot have it.",
                                ["run `planner jobs` to see the reservations",
                                 "schedule again: it plans around reserved devices"])
                        wanted.add((node, index))
            ids = []
            for job, devices in requests:
                cursor = db.execute("INSERT INTO reservations (cluster, job, owner, created, "
                                    "until) VALUES (?, ?, ?, ?, ?)",
                                    (cluster, job, owner, now, until))
                ids.append(int(cursor.lastrowid or 0))
                db.executemany("INSERT INTO held (reservation, cluster, node, device) "
                               "VALUES (?, ?, ?, ?)",
                               [(ids[-1], cluster, node, int(i)) for node, indices in
                                devices.items() for i in indices])
            return [_read(db, i) for i in ids]

    def cancel(self, reservation: int) -> Reservation:
        """End a reservation now; its devices are free again."""
        with self._transaction() as db:
            row = db.execute("SELECT cancelled FROM reservations WHERE id = ?",
                             (reservation,)).fetchone()
            if row is None:
                raise PlannerError("unknown-reservation", f"There is no reservation "
                                   f"{reservation} in {str(self.path)!r}.",
                                   ["run `planner jobs` to list them"])
            if row[0] is None:
                db.execute("UPDATE reservations SET cancelled = ? WHERE id = ?",
                           (time.time(), reservation))
                db.execute("UPDATE held SET active = 0 WHERE reservation = ?", (reservation,))
            return _read(db, reservation)

    def reservations(self, cluster: str | None = None, *, ended: bool = False
                     ) -> list[Reservation]:
        """Reservations, oldest first: active ones (with `ended`, all)."""
        now = time.time()
        with self._transaction() as db:
            ids = [r[0] for r in db.execute(
                "SELECT id FROM reservations WHERE (? IS NULL OR cluster = ?) ORDER BY id",
                (cluster, cluster))]
            out = [_read(db, i) for i in ids]
        return [r for r in out if ended or r.active(now)]


def _held(db: sqlite3.Connection, cluster: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for node, device in db.execute("SELECT node, device FROM held WHERE cluster = ? AND "
                                   "active = 1", (cluster,)):
        out.setdefault(node, set()).add(int(device))
    return out


def _holder(db: sqlite3.Connection, cluster: str, node: str, device: int) -> str | None:
    row = db.execute("SELECT r.job FROM held h JOIN reservations r ON r.id = h.reservation "
                     "WHERE h.cluster = ? AND h.node = ? AND h.device = ? AND h.active = 1",
                     (cluster, node, device)).fetchone()
    return None if row is None else str(row[0])


def _read(db: sqlite3.Connection, reservation: int) -> Reservation:
    row = db.execute("SELECT id, cluster, job, owner, created, until, cancelled FROM "
                     "reservations WHERE id = ?", (reservation,)).fetchone()
    devices: dict[str, list[int]] = {}
    for node, device in db.execute("SELECT node, device FROM held WHERE reservation = ? "
                                   "ORDER BY node, device", (reservation,)):
        devices.setdefault(str(node), []).append(int(device))
    return Reservation(id=int(row[0]), cluster=str(row[1]), job=str(row[2]), owner=str(row[3]),
                       created=float(row[4]), until=row[5], cancelled=row[6],
                       devices=tuple((n, tuple(d)) for n, d in devices.items()))
