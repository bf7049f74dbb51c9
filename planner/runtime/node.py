"""`python -m planner.runtime.node`: what each node's launch script runs. It meets the
plan's other nodes, runs torchrun in this process, and says which rank failed first.

    python -m planner.runtime.node --plan plan.json --node NAME --head ADDR --port PORT
        --run-dir DIR [--local-addr ADDR] [--max-restarts N] [--rendezvous-timeout S]
        [-- RUNTIME_ARGS...]

1. Arrival: node rank 0's launcher hosts a TCP store at HEAD:PORT; every launcher writes
   its node's name there and waits until every node of the plan has, for up to the
   rendezvous timeout. Then it fails naming the nodes that never arrived (node rank 0's
   own store unreachable names node 0), where torchrun alone waited without a word.
2. torchrun, in this process, with its c10d rendezvous on the same store (a process
   hosts one server per port; the other nodes' agents are its clients): when a rank
   fails, its node's agent re-rendezvouses and every other node's agent restarts its
   ranks too (it sees a node waiting), so all nodes take each restart together, up to
   --max-restarts, and the ranks resume from the newest intact checkpoint. torchrun
   numbers nodes as they join, so the ranks take their plan ranks from PLANNER_NODE and
   LOCAL_RANK (PLANNER_RANKS=plan, `env.py`), and meet in a store torchrun's rank 0
   hosts afresh every attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; a store that
   outlived an attempt would hand the new ranks the dead ones' addresses). Each rank's
   output also goes to RUN_DIR/logs/node-<rank>/ (torchrun's --tee).
3. When torchrun gives up, the node's failures go to RUN_DIR/failures/node-<rank>.json
   and the report (`failures.py`) names the rank that failed first and why.

The launcher keeps a record of its node in RUN_DIR/nodes/<node>.json: its host and pid
when it starts ("running"), how it ended when it ends ("done", "failed", "stopped" by a
signal, or "error" with the message). A node whose record still says "running" once the
run is over ended without a word: its launcher was killed or its host went down. The
supervisor (`supervise.py`) takes such nodes for lost.

SIGUSR1 (SLURM's --signal before a time limit) is passed on to this node's ranks, which
checkpoint after the step in progress and end (`guard.py`); the launcher itself keeps
running to see them out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.runtime import failures
from planner.runtime.layout import Layout, NodeRanks

DEFAULT_RENDEZVOUS_TIMEOUT = 600.0
_POLL = 0.5  # seconds between looks at the arrivals


@dataclass(frozen=True)
class NodeOptions:
    plan: Path
    node: str
    head: str  # node rank 0's address: the arrival store and the c10d rendezvous
    port: int
    run_dir: Path
    local_addr: str | None = None  # this node's address, as the others reach it
    max_restarts: int = 0
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT
    runtime_args: tuple[str, ...] = ()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m planner.runtime.node",
        description="Run one node of a plan: meet the other nodes, run torchrun (c10d "
        "rendezvous), report the first failure. Arguments after -- go to the runtime.")
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--node", required=True, help="The plan node this host plays.")
    p.add_argument("--head", required=True, help="Node rank 0's address.")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--local-addr", default=None)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--rendezvous-timeout", type=float, default=DEFAULT_RENDEZVOUS_TIMEOUT)
    p.add_argument("runtime_args", nargs=argparse.REMAINDER)
    return p


@dataclass(frozen=True)
class NodeRecord:
    """What a node's launcher says about its node (RUN_DIR/nodes/<node>.json)."""

    node: str
    node_rank: int
    host: str  # the host name the launcher ran on
    pid: int
    started: float  # seconds since the epoch
    status: str  # "running", "done", "failed", "stopped" or "error"
    code: int | None = None  # the launcher's exit code, once it ended
    ended: float | None = None
    message: str = ""


def records_dir(run_dir: Path) -> Path:
    return run_dir / "nodes"


def record_file(run_dir: Path, name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return records_dir(run_dir) / f"{safe}.json"


def write_record(run_dir: Path, record: NodeRecord) -> None:
    """Write the record whole (a temporary file renamed), so a reader never sees half."""
    path = record_file(run_dir, record.node)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(record)) + "\n")
        tmp.replace(path)
    except OSError as exc:
        raise PlannerError("bad-path", f"Node {record.node} cannot write its record "
                           f"{path} ({exc.strerror or exc}); the run directory must be "
                           "writable, and shared by every node.",
                           ["give a writable --run-dir (PLANNER_RUN_DIR)"]) from None


def read_records(run_dir: Path) -> dict[str, NodeRecord]:
    """Every node's record by node name (one that cannot be read is passed over)."""
    out = {}
    for path in sorted(records_dir(run_dir).glob("*.json")):
        try:
            record = NodeRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        out[record.node] = record
    return out


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM before torchrun runs (torchrun handles it after): end with the record."""
    raise SystemExit(128 + signum)


def _node(layout: Layout, name: str, plan: Path) -> NodeRanks:
    for node in layout.nodes:
        if node.name == name:
            return node
    raise PlannerError("bad-environment", f"--node {name!r}: {plan} uses no such node; its "
                       f"nodes are {', '.join(n.name for n in layout.nodes)}.",
                       ["run the script `planner launch` wrote for each node"])


def _arrival_key(name: str) -> str:
    return f"planner/arrived/{name}"


def arrive(layout: Layout, node: NodeRanks, options: NodeOptions) -> Any:
    """Meet every node of the plan at HEAD:PORT (node rank 0 hosts the store); the store,
    which node rank 0 must keep open for torchrun's rendezvous, or an error naming the
    nodes that never arrived within the rendezvous timeout."""
    from torch.distributed import TCPStore

    timeout = options.rendezvous_timeout
    where = f"{options.head}:{options.port}"
    head = layout.nodes[0]
    try:
        store = TCPStore(options.head, options.port, is_master=node.node_rank == 0,
                         multi_tenant=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, OSError) as exc:
        if node.node_rank == 0:
            taken = "EADDRINUSE" in str(exc)
            raise PlannerError(
                "rendezvous", f"Node {node.name} (node rank 0) could not open the rendezvous "
                f"at {where}: " + (f"port {options.port} is in use (another run?)" if taken
                                   else str(exc).splitlines()[0] if str(exc)
                                   else type(exc).__name__) + ".",
                ["set PLANNER_MASTER_PORT to a free port (planner launch --master-port)",
                 "check that the address is this host's (--hosts addr)"]) from None
        raise PlannerError(
            "rendezvous", f"Node {node.name} could not reach node {head.name} (node rank 0) at "
            f"{where} within {timeout:g} s: node {head.name}'s script has not started, or "
            f"{where} cannot be reached from here.",
            [f"start node {head.name}'s script (every node's, in any order)",
             f"check that this host reaches {where} (firewall, --hosts addr)",
             "give slow starts more time: PLANNER_RDZV_TIMEOUT=SECONDS"]) from None
    names = [n.name for n in layout.nodes]
    deadline = time.monotonic() + timeout
    try:
        store.set(_arrival_key(node.name), node.name)
        while True:
            missing = [name for name in names if not store.check([_arrival_key(name)])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(_POLL)
    except (RuntimeError, OSError) as exc:
        raise PlannerError(
            "rendezvous", f"Node {node.name} lost the rendezvous at {where} while the nodes "
            f"met: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; node "
            f"{head.name} (node rank 0), which hosts it, ended or became unreachable.",
            [f"see node {head.name}'s output", "start every node's script again"]) from None
    if missing:
        hosts = {n.name: n.host for n in layout.nodes}
        named = ", ".join(f"{name}" + (f" (host {hosts[name]})" if hosts[name] else "")
                          for name in missing)
        raise PlannerError(
            "rendezvous", f"Node {node.name} waited {timeout:g} s at {where} for the plan's "
            f"{len(names)} nodes, and {len(missing)} never arrived: {named}.",
            ["start the script `planner launch` wrote for each of them",
             f"check that they reach {where} (firewall, --hosts addr)",
             "give slow starts more time: PLANNER_RDZV_TIMEOUT=SECONDS"])
    return store


def torchrun_args(layout: Layout, node: NodeRanks, options: NodeOptions) -> list[str]:
    """torchrun's command line for this node (see the module docstring)."""
    conf = (f"is_host={'true' if node.node_rank == 0 else 'false'},"
            f"join_timeout={max(1, round(options.rendezvous_timeout))}")
    args = [f"--nnodes={len(layout.nodes)}", f"--nproc-per-node={node.nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={options.head}:{options.port}",
            "--rdzv-id=planner", f"--rdzv-conf={conf}",
            f"--max-restarts={options.max_restarts}", "--monitor-interval=1",
            f"--log-dir={options.run_dir / 'logs' / f'node-{node.node_rank}'}", "--tee=3"]
    if options.local_addr:
        args.append(f"--local-addr={options.local_addr}")
    return [*args, "-m", "planner.runtime", "--plan", str(options.plan),
            "--run-dir", str(options.run_dir), *options.runtime_args]


@dataclass(frozen=True)
class Forward:
    """Passes a signal on to this node's ranks: the processes whose pid files the ranks
    wrote (RUN_DIR/pids/rank-R.pid) and whose parent is this launcher (a stale pid file
    never names another process)."""

    run_dir: Path
    ranks: range

    def handle(self, signum: int, frame: Any) -> None:
        for rank in self.ranks:
            try:
                pid = int((self.run_dir / "pids" / f"rank-{rank}.pid").read_text())
                parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
                if parent == os.getpid():
                    os.kill(pid, signum)
            except (OSError, ValueError, IndexError):
                continue


def launch_node(options: NodeOptions) -> int:
    """Run this node of the plan; 0 when torchrun succeeded, 1 when it gave up. The node's
    record says how it went (see the module docstring)."""
    from planner.planfile import read_plan
    from planner.runtime.layout import rank_layout

    layout = rank_layout(read_plan(options.plan))
    node = _node(layout, options.node, options.plan)
    record = NodeRecord(node=node.name, node_rank=node.node_rank, host=socket.gethostname(),
                        pid=os.getpid(), started=time.time(), status="running")
    signal.signal(signal.SIGTERM, _stop)
    status, code, message = "error", 1, ""
    try:
        write_record(options.run_dir, record)
        code = _run_node(options, layout, node)
        status = "done" if code == 0 else "failed" if code == 1 else "stopped"
        return code
    except Exception as exc:
        message = (exc.message if isinstance(exc, PlannerError)
                   else f"{type(exc).__name__}: {exc}")
        raise
    except SystemExit as exc:  # SIGTERM before torchrun ran
        status, code = "stopped", exc.code if isinstance(exc.code, int) else 1
        raise
    except KeyboardInterrupt:
        status, code = "stopped", 128 + signal.SIGINT
        raise
    finally:
        with contextlib.suppress(PlannerError):  # (the error that ended it says more)
            write_record(options.run_dir, replace(
                record, status=status, code=code, ended=time.time(), message=message))


def _run_node(options: NodeOptions, layout: Layout, node: NodeRanks) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    from planner.runtime.guard import STOP_SIGNAL

    failures.node_file(options.run_dir, node.node_rank).unlink(missing_ok=True)
    store = arrive(layout, node, options)  # open until torchrun ends: node rank 0 hosts it
    os.environ.update({"PLANNER_RANKS": "plan", "PLANNER_NODE": node.name,
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    signal.signal(STOP_SIGNAL, Forward(options.run_dir, node.ranks).handle)
    try:
        run(parse_args(torchrun_args(layout, node, options)))
    except ChildFailedError as exc:
        found = failures.from_torchrun(exc.failures, layout, node)
        failures.write_node(options.run_dir, node.node_rank, found)
        text = failures.report(failures.read_all(options.run_dir))
        print(f"planner node {node.name}: the run failed"
              + (f" (restarts allowed: {options.max_restarts})" if options.max_restarts else "")
              + (f"; {text}" if text else "."), file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:  # SIGTERM or SIGINT: torchrun stopped the ranks
        print(f"planner node {node.name}: stopped by signal {exc.sigval.name}",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except RendezvousError as exc:
        raise PlannerError(
            "rendezvous", f"Node {node.name}: torchrun's rendezvous at {options.head}:"
            f"{options.port} failed ({type(exc).__name__}: {exc}): after a failure a node "
            f"did not rejoin within {options.rendezvous_timeout:g} s, or node rank 0 ended.",
            ["see every node's output for the first failure",
             "a node that is lost for good needs a plan without it (planner replan PLAN "
             "--lost NODE, or planner launch --supervise)"]) from None
    del store  # (torchrun's exit barrier has every node's agent done with it)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    extra = args.runtime_args[1:] if args.runtime_args[:1] == ["--"] else args.runtime_args
    options = NodeOptions(plan=args.plan, node=args.node, head=args.head, port=args.port,
                          run_dir=args.run_dir, local_addr=args.local_addr,
                          max_restarts=args.max_restarts,
                          rendezvous_timeout=args.rendezvous_timeout,
                          runtime_args=tuple(extra))
    try:
        return launch_node(options)
    except PlannerError as exc:
        print(exc.report(), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
