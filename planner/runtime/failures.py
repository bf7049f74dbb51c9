"""Why a run failed, and which rank failed first.

A rank that fails records why (`record`) in torchrun's error file for its attempt
(TORCHELASTIC_ERROR_FILE, which its agent reads back), in the format of torch's own
error handler plus the planner's fields: the time, the message and remedies, and a
kind: "peer-lost" where a collective or the store failed because another rank went
away (the rank is a victim, not the cause), else "error" (a PlannerError: one paragraph
and remedies) or "exception" (anything else: its traceback is in the log). A rank
killed by a signal records nothing; torchrun has its exit code.

Each node's launcher (`node.py`) turns its torchrun's final failures into Failures
(`from_torchrun`: the plan rank, node, pipeline and stage from the local rank) and
writes them to RUN_DIR/failures/node-<rank>.json; `report` reads
every node's file and names the first failure: the earliest rank that failed on its
own (an error, a signal, an exit), ahead of the ranks that then lost it. torchrun's own
summary names whichever rank its agent saw first, often a victim ("Connection closed by
peer").

    python -m planner.runtime.failures RUN_DIR   # the report; exit 1 if there is none
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from planner.errors import PlannerError

# what gloo, NCCL and the TCP store say when the other end of a connection went away
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote process exited", "socket closed", "communicator was aborted",
              "connection refused", "timed out waiting")


@dataclass(frozen=True)
class Failure:
    """How one rank ended, as the report names it."""

    rank: int
    node: str
    pipeline: int
    stage: int
    time: float  # seconds since the epoch
    kind: str  # "error", "exception", "peer-lost", "stopped", "signal" or "exit"
    message: str
    remedies: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"rank {self.rank} (node {self.node}, pipeline {self.pipeline} stage {self.stage})"


def kind_of(exc: BaseException) -> str:
    """"peer-lost" where `exc` (or an exception it chains) says another rank went away,
    else "error" for a PlannerError and "exception" for the rest."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, PlannerError) and seen.kind == "rendezvous":
            return "peer-lost"  # it waited for ranks that never came
        text = str(seen).lower()
        if type(seen).__name__ in ("DistNetworkError", "DistBackendError") or any(
                marker in text for marker in _PEER_LOST):
            return "peer-lost"
        seen = seen.__cause__ or seen.__context__
    return "error" if isinstance(exc, PlannerError) else "exception"


def describe(exc: BaseException) -> tuple[str, tuple[str, ...]]:
    """The message and remedies a report shows for `exc`."""
    if isinstance(exc, PlannerError):
        return exc.message, exc.remedies
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": "), ()


def record(env: Mapping[str, str], exc: BaseException) -> None:
    """Write this rank's failure into torchrun's error file, if torchrun gave one (its
    launcher knows the rank's place in the plan); a KeyboardInterrupt or SystemExit is
    no failure of the rank's own."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return
    message, remedies = describe(exc)
    now = time.time()
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(exc)),
        "timestamp": str(int(now))}},
        "planner": {"time": now, "kind": kind_of(exc), "message": message,
                    "remedies": list(remedies)}}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass  # the failure itself is what matters; torchrun still has the exit code


def from_torchrun(failed: Mapping[int, Any], layout: Any, node: Any) -> list[Failure]:
    """Failures from torchrun's ProcessFailures of one node (ChildFailedError.failures;
    `node` its NodeRanks in the plan's `layout`): the rank's own record where it wrote
    one, else its signal or exit code. torchrun ends a node's other ranks with SIGTERM
    when one fails: beside a failure of another kind, a SIGTERM is theirs ("stopped")."""
    out = []
    others = any(f.exitcode != -signal.SIGTERM for f in failed.values())
    for failure in failed.values():
        slot = layout.of(node.first_rank + failure.local_rank)
        where = {"rank": slot.rank, "node": slot.node, "pipeline": slot.pipeline,
                 "stage": slot.stage}
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        mine = data.get("planner")
        if isinstance(mine, dict):
            out.append(Failure(**where, time=float(mine["time"]), kind=str(mine["kind"]),
                               message=str(mine["message"]),
                               remedies=tuple(mine.get("remedies", ()))))
            continue
        if failure.exitcode == -signal.SIGTERM and others:
            message, kind = "stopped by torchrun when another rank of its node failed", "stopped"
        elif failure.exitcode < 0:
            try:
                name = signal.Signals(-failure.exitcode).name
            except ValueError:
                name = "?"
            message = (f"killed by signal {-failure.exitcode} ({name}), without a word: by a "
                       "person, the out-of-memory killer or the scheduler")
            kind = "signal"
        else:
            message = f"exited with code {failure.exitcode} before recording why"
            kind = "exit"
        out.append(Failure(**where, time=float(failure.timestamp), kind=kind,
                           message=message))
    return out


def failures_dir(run_dir: Path) -> Path:
    return run_dir / "failures"


def node_file(run_dir: Path, node_rank: int) -> Path:
    return failures_dir(run_dir) / f"node-{node_rank}.json"


def write_node(run_dir: Path, node_rank: int, found: Sequence[Failure]) -> None:
    path = node_file(run_dir, node_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps([asdict(f) for f in found], indent=1) + "\n")
    tmp.replace(path)


def read_all(run_dir: Path) -> list[Failure]:
    """Every node's recorded failures (a file that cannot be read is passed over)."""
    out = []
    for path in sorted(failures_dir(run_dir).glob("node-*.json")):
        try:
            rows = json.loads(path.read_text())
            out += [Failure(**{**row, "remedies": tuple(row.get("remedies", ()))})
                    for row in rows]
        except (OSError, ValueError, TypeError):
            continue
    return out


_VICTIMS = ("peer-lost", "stopped")  # failures another rank's caused


def first_failure(found: Sequence[Failure]) -> Failure | None:
    """The rank that failed first on its own (earliest; lowest rank on a tie), else the
    earliest victim."""
    if not found:
        return None
    return min(found, key=lambda f: (f.kind in _VICTIMS, f.time, f.rank))


def report(found: Sequence[Failure]) -> str | None:
    """The paragraph that says which rank failed first and why, then who lost it."""
    first = first_failure(found)
    if first is None:
        return None
    if first.kind == "error":
        lines = [f"{first.where} failed first:", f"error: {first.message}"]
        lines += [f"  {i}) {remedy}" for i, remedy in enumerate(first.remedies, 1)]
    elif first.kind in _VICTIMS:
        lines = [f"{first.where} failed first, {first.message}; no node recorded a rank that "
                 "failed on its own: a node may have been lost whole (see the other nodes' "
                 "output)." if first.kind == "stopped" else
                 f"{first.where} failed first, having lost a peer ({first.message}); no node "
                 "recorded a rank that failed on its own: a node may have been lost whole "
                 "(see the other nodes' output)."]
    elif first.kind == "exception":
        lines = [f"{first.where} failed first: {first.message} (its traceback is in the "
                 "node's output and the run directory's logs/)"]
    else:
        lines = [f"{first.where} failed first: it was {first.message}."
                 if first.kind == "signal" else f"{first.where} failed first: it {first.message}."]
    victims = sorted({f.rank for f in found if f.kind in _VICTIMS and f is not first})
    if victims:
        lines.append(f"Then rank(s) {', '.join(map(str, victims))} lost their connection to "
                     "the ranks that had failed, or were stopped with them.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m planner.runtime.failures RUN_DIR", file=sys.stderr)
        return 2
    text = report(read_all(Path(args[0])))
    if text is None:
        return 1
    print(text, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
