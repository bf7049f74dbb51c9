"""Launch scripts for a plan: a pure function from the plan to {file name: text}.

    files = render_launch(plan, target="torchrun", hosts=read_hosts("hosts.yaml"))

Targets:
  torchrun  one script per node (node-<rank>-<name>.sh): per-node environment
            (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, NCCL/gloo), then
            `python -m planner.runtime.node` (`runtime/node.py`): the nodes meet at
            node rank 0's address (a missing node is named), torchrun's c10d
            rendezvous restarts every node's ranks together, and a failure report
            names the rank that failed first; every rank runs `python -m planner.runtime`;
  slurm     the node scripts plus launch.sbatch: a heterogeneous job (one
            component per group of nodes with the same device type and device
            count) whose one srun step starts a task per node (slurm-task.sh picks
            the node's script); hosts and the head node come from SLURM at run time;
  local     run-local.sh: every node's launcher on this machine (127.0.0.1), all on
            the CPU with gloo, each optionally pinned to CPUs with taskset, for
            trying a plan without its cluster.

With `supervise`, any target also gets supervise.sh, the supervisor
(`runtime/supervise.py`: a lost node is re-planned around and the run resumed), and
launch.json, the options the files were rendered with (`read_launch`), so that the
supervisor renders a new plan's files alike.

Every script starts with `set -euo pipefail`, quotes every interpolated value
with shlex.quote (host names, paths, model and runtime arguments), keeps
comments free of line breaks, and passes ShellCheck. The output also holds the
plan (plan.json, which the scripts read from their own folder) and a README
saying what to run where.

Hosts (`read_hosts`): a YAML or JSON mapping from plan node names to a host name,
or to {host, addr, cpus, ifname, env}: `host` is a host name or IP address,
optionally user@ (what the README's ssh lines use), `addr` the address other
nodes reach it at (default: host, without user@), `cpus` a CPU list for taskset
(local and torchrun targets; it also sets OMP_NUM_THREADS), `ifname`
the network interface NCCL/gloo should use, `env` extra environment variables;
each value is one line of printable text.
Nodes without a host use the cluster file's host, else their node name
(`hostless_nodes` lists the latter, for a warning).

Before writing, `check_model` refuses a plan its ranks would refuse (the model
changed since the plan was made, or a model the runtime cannot run), and
`check_out` an --out folder that cannot be written.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PlannerError, closest
from planner.files import check_writable
from planner.planfile import plan_json
from planner.runtime.layout import Layout, NodeRanks, rank_layout
from planner.types import Plan

TARGETS = ("torchrun", "slurm", "local")
DEFAULT_PORT = 29500
DEFAULT_RENDEZVOUS_TIMEOUT = 600  # seconds the nodes wait for each other (runtime/node.py)
STOP_BEFORE_END = 300  # seconds before a SLURM time limit the ranks checkpoint and requeue
LOCAL_GRACE = 10  # seconds run-local.sh lets the other nodes record their failures
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CPUS = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
_SLURM_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?")
_USER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_IP_SCOPE = re.compile(r"[A-Za-z0-9_.-]+")
HOST_RULE = ("a host name (letters, digits, '-' and '_' in labels separated by dots, no label "
             "starting or ending with '-') or an IP address")


def is_host(text: str, *, user: bool = False) -> bool:
    """Whether `text` is a host name or an IP address (`user`: optionally after user@): what
    ssh, torchrun and SLURM take as a host. Never an option: a leading '-' would make the
    README's ssh line run a command here (ssh -oProxyCommand=...)."""
    if user and "@" in text:
        name, _, text = text.rpartition("@")
        if not _USER_NAME.fullmatch(name):
            return False
    if _HOST_NAME.fullmatch(text):
        return True
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    scope = getattr(address, "scope_id", None)  # fe80::1%eth0
    return scope is None or bool(_IP_SCOPE.fullmatch(scope))


@dataclass(frozen=True)
class HostEntry:
    host: str | None = None  # None: the cluster file's host, else the node's name
    addr: str | None = None
    cpus: str | None = None
    ifname: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """The address other nodes reach the host at: addr, else the host without user@."""
        return self.addr or (self.host or "").rpartition("@")[2]


def parse_hosts(data: Any, source: str) -> dict[str, HostEntry]:
    """Host entries from a parsed hosts file (see the module docstring)."""
    if not isinstance(data, dict):
        raise PlannerError("bad-hosts", f"{source}: a hosts file maps plan node names to "
                           "hosts, e.g. `a100-0: gpu-a1`.")
    out: dict[str, HostEntry] = {}
    for node, value in data.items():
        where = f"{source}: node {node!r}"
        if isinstance(value, str):
            value = {"host": value}
        if not isinstance(value, dict):
            raise PlannerError("bad-hosts", f"{where}: expected a host name or a mapping with "
                               f"host, addr, cpus, ifname, env (got {value!r}).")
        unknown = set(value) - {"host", "addr", "cpus", "ifname", "env"}
        if unknown:
            raise PlannerError("bad-hosts", f"{where}: unknown field(s) "
                               f"{', '.join(sorted(map(str, unknown)))}; the fields are host, "
                               "addr, cpus, ifname, env.")
        env = value.get("env") or {}
        if not isinstance(env, dict):
            raise PlannerError("bad-hosts", f"{where}: env must map variable names to values.")
        for key in env:
            if not _ENV_NAME.match(str(key)):
                raise PlannerError("bad-hosts", f"{where}: {key!r} is not an environment "
                                   "variable name.")
        for key, text in [*((k, value.get(k)) for k in ("host", "addr", "ifname")),
                          *((f"env {k}", v) for k, v in env.items())]:
            if text is not None and not str(text).isprintable():
                raise PlannerError("bad-hosts", f"{where}: {key} {str(text)!r} has a line "
                                   "break or another control character; host names, "
                                   "addresses, interfaces and env values must be one line "
                                   "of printable text.")
        for key in ("host", "addr", "ifname"):  # (else an empty one was taken as none)
            if value.get(key) is not None and not str(value[key]).strip():
                raise PlannerError("bad-hosts", f"{where}: {key} is empty.",
                                   [f"give the {key}, or leave the field out"])
        for key, user in (("host", True), ("addr", False)):
            text = value.get(key)
            if text is not None and not is_host(str(text), user=user):
                raise PlannerError(
                    "bad-hosts", f"{where}: {key} {str(text)!r} is not {HOST_RULE}"
                    + (", optionally after user@." if user else "."),
                    [f"give the node's {key}, e.g. `{node}: "
                     + (f"gpu-a1` or `{node}: alice@10.0.0.1`" if user
                        else "{host: gpu-a1, addr: 10.0.0.1}`")])
        cpus = value.get("cpus")
        if cpus is not None and not _CPUS.match(str(cpus)):
            raise PlannerError("bad-hosts", f"{where}: cpus {cpus!r} is not a CPU list like "
                               "0-3,8 (what taskset -c takes).")
        out[str(node)] = HostEntry(
            host=str(value["host"]) if value.get("host") else None,
            addr=str(value["addr"]) if value.get("addr") else None,
            cpus=str(cpus) if cpus is not None else None,
            ifname=str(value["ifname"]) if value.get("ifname") else None,
            env={str(k): str(v) for k, v in env.items()})
    return out


def read_hosts(path: Path) -> dict[str, HostEntry]:
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        raise PlannerError("bad-hosts", f"Cannot read the hosts file {path}: "
                           f"{exc.strerror or exc}.") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise PlannerError("bad-hosts", f"{path} is not valid "
                           f"{'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
    return parse_hosts(data, str(path))


def _comment(text: str) -> str:
    """Text safe inside a shell comment: no line breaks or other control characters."""
    return "".join(c if c.isprintable() else "?" for c in text)


_QUOTED_EXPANSION = re.compile(r"'[^'\n]*[$`][^'\n]*'")


def _literal_note(script: str) -> str:
    """Tell ShellCheck that single-quoted values holding $ or ` are literal on purpose
    (a host name or argument with such characters is passed as it is, never run)."""
    if not _QUOTED_EXPANSION.search(script):
        return script
    shebang, _, rest = script.partition("\n")
    return (f"{shebang}\n# Values in single quotes are literal on purpose:\n"
            f"# shellcheck disable=SC2016\n{rest}")


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def node_script(node: NodeRanks) -> str:
    return f"node-{node.node_rank}-{_file_part(node.name)}.sh"


def _cpu_count(cpus: str) -> int:
    count = 0
    for part in cpus.split(","):
        a, _, b = part.partition("-")
        count += int(b or a) - int(a) + 1
    return count


def host_of(node: NodeRanks, hosts: Mapping[str, HostEntry]) -> HostEntry:
    """The node's entry in `hosts`, its host filled in: the given one, else the cluster
    file's, else the node's name."""
    entry = hosts.get(node.name) or HostEntry()
    return entry if entry.host else dataclasses.replace(entry, host=node.host or node.name)


@dataclass(frozen=True)
class SuperviseOptions:
    """What `supervise.sh` (`runtime/supervise.py`) is given: how many times it may
    re-plan, and the seconds each re-plan's search may take."""

    max_replans: int = 3
    time_limit: float = 10.0


@dataclass(frozen=True)
class _Setup:
    plan: Plan
    layout: Layout
    hosts: dict[str, HostEntry]
    port: int
    max_restarts: int
    runtime_args: tuple[str, ...]
    python: str
    run_dir: str | None
    rendezvous_timeout: int = DEFAULT_RENDEZVOUS_TIMEOUT

    def host(self, node: NodeRanks) -> HostEntry:
        return host_of(node, self.hosts)

    @property
    def master(self) -> HostEntry:
        return self.host(self.layout.nodes[0])


def _listed_host(hosts: Mapping[str, HostEntry], node: NodeRanks) -> str | None:
    """The host `hosts` (a hosts file, --cpus) gives the node, if any."""
    entry = hosts.get(node.name)
    return entry.host if entry else None


def _check_hosts(plan: Plan, layout: Layout, hosts: Mapping[str, HostEntry]) -> None:
    names = [n.name for n in layout.nodes]
    for node in hosts:
        if node not in names:
            near = closest(node, names)
            hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
            unused = node in {n.name for n in plan.cluster.nodes}
            raise PlannerError(
                "bad-hosts", f"--hosts/--cpus name node {node!r}, which "
                + ("the plan does not use." if unused else "the plan's cluster does not have.")
                + hint, [f"the plan's nodes are {', '.join(names)}"])


def _check_plan_hosts(setup: _Setup) -> None:
    """An error where a node's host comes from the plan's cluster file and is no host name
    (a hosts file's are checked as it is read; a node's own name, used where neither gives
    a host, gets the warning `hostless_nodes` is for)."""
    for node in setup.layout.nodes:
        if node.host and not _listed_host(setup.hosts, node) and not is_host(node.host,
                                                                             user=True):
            raise PlannerError(
                "bad-hosts", f"Node {node.name!r} has no host in --hosts, and its cluster file "
                f"gives it host {node.host!r}, which is not {HOST_RULE}.",
                [f"map the node to its host in a hosts file (--hosts FILE), e.g. "
                 f"`{node.name}: gpu-a1`", "or correct its host in the cluster file and "
                 "solve again"])


def hostless_nodes(plan: Plan, hosts: Mapping[str, HostEntry]) -> list[str]:
    """The plan's nodes that neither `hosts` nor the cluster file give a host: their
    scripts use the node's name, which the planner made up (a100-80g-sxm-0), as its host."""
    return [node.name for node in rank_layout(plan).nodes
            if not node.host and not _listed_host(hosts, node)]


def _check_one_node_per_host(setup: _Setup) -> None:
    """An error where two of the plan's nodes would run on one host: each node's script
    starts its own torchrun there on the node's devices, so both would take the same GPUs."""
    seen: dict[str, tuple[str, str]] = {}  # a host or address, as DNS compares them
    for node in setup.layout.nodes:
        entry = setup.host(node)
        for name in dict.fromkeys((entry.host, entry.address)):
            key = name.lower().rstrip(".")
            if key in seen:
                other, said = seen[key]
                raise PlannerError(
                    "bad-hosts", f"Nodes {other!r} and {node.name!r} both run on host "
                    f"{said!r}" + ("" if said == name else f" (as {name!r})") + ": each "
                    "node's script starts its own torchrun there on the node's devices, so "
                    "the two would share the same GPUs.",
                    [f"give {node.name!r} a host of its own in --hosts",
                     "or use --target local to try the plan on one machine"])
        for name in (entry.host, entry.address):
            seen.setdefault(name.lower().rstrip("."), (node.name, name))


def _preamble(title: Sequence[str]) -> list[str]:
    lines = ["#!/usr/bin/env bash"]
    lines += [f"# {_comment(t)}" for t in title]
    lines += ["set -euo pipefail", "",
              'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"']
    return lines


def _run_dir_word(setup: _Setup) -> str:
    """The run directory as a shell word: --run-dir, else run/ in the launch folder."""
    return '"$HERE/run"' if setup.run_dir is None else shlex.quote(setup.run_dir)


def _common_vars(setup: _Setup) -> list[str]:
    q = shlex.quote
    return [
        'PLAN="$HERE/plan.json"', f"RUN_DIR={_run_dir_word(setup)}", f"PYTHON={q(setup.python)}",
        f"PORT={setup.port}", f"RDZV_TIMEOUT={setup.rendezvous_timeout}",
        f"RUNTIME_ARGS=({' '.join(q(a) for a in setup.runtime_args)})",
        "# overrides from the environment",
        'PLAN="${PLANNER_PLAN:-$PLAN}"', 'RUN_DIR="${PLANNER_RUN_DIR:-$RUN_DIR}"',
        'PYTHON="${PLANNER_PYTHON:-$PYTHON}"', 'PORT="${PLANNER_MASTER_PORT:-$PORT}"',
        'RDZV_TIMEOUT="${PLANNER_RDZV_TIMEOUT:-$RDZV_TIMEOUT}"',
    ]


def _launcher(setup: _Setup, node: NodeRanks, *, head: str, local_addr: str,
              extra: Sequence[str] = (), indent: str = "", prefix: str = "") -> list[str]:
    """The node's launcher command (`runtime/node.py`: torchrun, c10d rendezvous); `head`
    and `local_addr` are shell words (a quoted value or "$VAR")."""
    q = shlex.quote
    return [f'{indent}{prefix}"$PYTHON" -m planner.runtime.node --plan "$PLAN" '
            f'--run-dir "$RUN_DIR" --node {q(node.name)} \\',
            f'{indent}  --head {head} --port "$PORT" --local-addr {local_addr} '
            f'--max-restarts {setup.max_restarts} --rendezvous-timeout "$RDZV_TIMEOUT" \\',
            f'{indent}  -- ${{RUNTIME_ARGS[@]+"${{RUNTIME_ARGS[@]}}"}}'
            + "".join(f" {q(e)}" for e in extra) + ' "$@"']


def _node_env(setup: _Setup, node: NodeRanks, entry: HostEntry) -> list[str]:
    q = shlex.quote
    lines = [f"export PLANNER_NODE={q(node.name)}"]
    if node.is_cpu:
        lines.append('export CUDA_VISIBLE_DEVICES=""')
    else:
        devices = ",".join(str(d) for d in node.devices)
        lines += ["# SLURM (PLANNER_SET_DEVICES=0) assigns the GPUs itself",
                  'if [ "${PLANNER_SET_DEVICES:-1}" = 1 ]; then',
                  f"  export CUDA_VISIBLE_DEVICES={q(devices)}", "fi",
                  'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"',
                  "# fail collectives with a dead peer instead of hanging, so torchrun can "
                  "restart", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1"]
    if entry.ifname:
        lines += [f"export NCCL_SOCKET_IFNAME={q(entry.ifname)}",
                  f"export GLOO_SOCKET_IFNAME={q(entry.ifname)}"]
    threads = (f"{max(1, _cpu_count(entry.cpus) // node.nproc)}" if entry.cpus
               else f"$(( $(nproc) / {node.nproc} ))")
    lines += ['if [ -z "${OMP_NUM_THREADS:-}" ]; then',
              f"  OMP_NUM_THREADS={threads}",
              '  if [ "$OMP_NUM_THREADS" -lt 1 ]; then OMP_NUM_THREADS=1; fi', "fi",
              "export OMP_NUM_THREADS"]
    lines += [f"export {k}={q(v)}" for k, v in sorted(entry.env.items())]
    return lines


def _render_node(setup: _Setup, node: NodeRanks) -> str:
    entry = setup.host(node)
    nodes = len(setup.layout.nodes)
    lines = _preamble([
        f"planner launch: node {node.name} (node rank {node.node_rank} of {nodes}), "
        f"{node.nproc} rank(s): global ranks {node.first_rank}-{node.first_rank + node.nproc - 1}"
        f", devices {','.join(map(str, node.devices))} ({node.device_type}).",
        f"Run it on host {entry.host}; start every node's script (any order, within the "
        "rendezvous timeout).",
        "Arguments after the script name go to python -m planner.runtime."])
    lines += _common_vars(setup)
    lines += ["# node rank 0's address (the rendezvous) and this node's, as the others reach "
              "them (SLURM sets both at run time)",
              f"HEAD={shlex.quote(setup.master.address)}",
              f"LOCAL_ADDR={shlex.quote(entry.address)}",
              'HEAD="${PLANNER_MASTER_ADDR:-$HEAD}"',
              'LOCAL_ADDR="${PLANNER_LOCAL_ADDR:-$LOCAL_ADDR}"', ""]
    lines += _node_env(setup, node, entry)
    lines.append("")
    pin = ""
    if entry.cpus:
        lines += _need_taskset(node_script(node))
        pin = f"taskset -c {shlex.quote(entry.cpus)} "
    lines += _launcher(setup, node, head='"$HEAD"', local_addr='"$LOCAL_ADDR"',
                       prefix="exec " + pin)
    return "\n".join(lines) + "\n"


def _need_taskset(script: str) -> list[str]:
    return ["if ! command -v taskset >/dev/null 2>&1; then",
            f'  echo "{script}: taskset is needed to pin ranks to CPUs" >&2', "  exit 1", "fi"]


def _render_local(setup: _Setup) -> str:
    q = shlex.quote
    world, nodes = setup.layout.world_size, setup.layout.nodes
    lines = _preamble([
        f"planner launch (local): the plan's {world} rank(s) on {len(nodes)} node(s), all on "
        "this machine, on the CPU with gloo.",
        "Each node gets its own launcher and torchrun (c10d rendezvous on 127.0.0.1), "
        "optionally pinned to CPUs with taskset.",
        "Arguments go to python -m planner.runtime; logs go to $PLANNER_LOGS "
        "(default: logs/ here)."])
    lines += _common_vars(setup)
    lines += ['LOGS="${PLANNER_LOGS:-$HERE/logs}"', 'mkdir -p "$LOGS"', ""]
    if any(setup.host(n).cpus for n in nodes):
        lines += _need_taskset("run-local.sh")
    lines += ["pids=()", "stop() {",
              '  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done', "}",
              "trap stop INT TERM", ""]
    for node in nodes:
        entry = setup.host(node)
        log = f"{node_script(node)[:-3]}.log"
        pin = f"taskset -c {q(entry.cpus)} " if entry.cpus else ""
        threads = max(1, _cpu_count(entry.cpus) // node.nproc) if entry.cpus else 1
        lines.append(f"# node {node.name}: node rank {node.node_rank}, {node.nproc} rank(s)"
                     + (f", CPUs {entry.cpus}" if entry.cpus else ""))
        env = [f"PLANNER_NODE={q(node.name)}", 'CUDA_VISIBLE_DEVICES=""',
               f'OMP_NUM_THREADS="${{PLANNER_THREADS:-{threads}}}"',
               *(f"{k}={q(v)}" for k, v in sorted(entry.env.items()))]
        run = _launcher(setup, node, head="127.0.0.1", local_addr="127.0.0.1",
                        extra=("--cpu",), indent="  ", prefix=pin)
        run[0] = "env " + " ".join(env) + " \\\n" + run[0]
        run[-1] += f' \\\n  >"$LOGS"/{q(log)} 2>&1 &'
        lines += run
        lines += ['pids+=("$!")', ""]
    lines += [
        "status=0",
        'for _ in "${pids[@]}"; do',
        "  if ! wait -n; then",
        "    status=1",
        '    echo "run-local.sh: a node failed; stopping the others (logs: $LOGS)" >&2',
        "    # the others end by themselves once their ranks lose the failed ones: a while",
        "    # to record their failures for the report, then they are stopped",
        f"    for _ in $(seq {LOCAL_GRACE}); do",
        "      alive=0",
        '      for pid in "${pids[@]}"; do if kill -0 "$pid" 2>/dev/null; then alive=1; fi; done',
        '      if [ "$alive" = 0 ]; then break; fi',
        "      sleep 1",
        "    done",
        "    stop",
        "    break",
        "  fi",
        "done",
        "wait || true",
        'if [ "$status" = 0 ]; then',
        '  echo "run-local.sh: done; summary: $RUN_DIR/summary.json, logs: $LOGS"',
        "# the rank that failed first and why (runtime/failures.py), else the first error",
        "# paragraph in the logs, else the cause",
        'elif ! "$PYTHON" -m planner.runtime.failures "$RUN_DIR"; then',
        '  reason=$(cat "$LOGS"/*.log 2>/dev/null | awk \'/^error: /{if (found) exit; found=1; '
        'print; next} found && /^  [0-9]+\\) /{print; next} found{exit}\' || true)',
        '  if [ -n "$reason" ]; then',
        '    printf \'%s\\n\' "$reason" >&2',
        '  elif grep -qs EADDRINUSE "$LOGS"/*.log; then',
        '    echo "run-local.sh: port $PORT is in use (another run?): run again with" \\',
        '      "PLANNER_MASTER_PORT set to a free port" >&2',
        "  else  # a traceback's last line (the exception), else each log's last line",
        '    cause=$(grep -hE \'^(\\[rank[0-9]+\\]: )?[A-Za-z_.]*(Error|Exception): \' '
        '"$LOGS"/*.log 2>/dev/null | head -n 1 || true)',
        '    if [ -n "$cause" ]; then',
        '      printf \'run-local.sh: the first error in the logs: %s\\n\' "$cause" >&2',
        "    else",
        '      tail -q -n 1 "$LOGS"/*.log >&2 || true',
        "    fi",
        "  fi",
        "fi",
        'exit "$status"']
    return "\n".join(lines) + "\n"


def _slurm_groups(setup: _Setup) -> list[list[NodeRanks]]:
    groups: dict[tuple[str, int], list[NodeRanks]] = {}
    for node in setup.layout.nodes:
        groups.setdefault((node.device_type, node.nproc), []).append(node)
    return list(groups.values())


@dataclass(frozen=True)
class SlurmOptions:
    """What the SLURM target adds: extra #SBATCH lines (`sbatch`, given to every component),
    and per device type a --constraint (the node features that type's nodes carry) and a
    --gres (in place of --gpus-per-node), keyed by the plan's device type names."""

    sbatch: tuple[str, ...] = ()
    constraints: Mapping[str, str] = field(default_factory=dict)
    gres: Mapping[str, str] = field(default_factory=dict)


_SLURM_VALUE = re.compile(r"^[A-Za-z0-9_.:&|*()\[\],+=-]+$")
# what the script sets itself; a user's --signal or --requeue/--no-requeue replaces its own
_SLURM_PLANNED = ("--job-name", "--nodes", "--nodelist", "--ntasks-per-node", "--exclusive",
                  "--gpus-per-node", "--constraint", "--gres", "--cpus-per-task", "--hetjob")


def _check_slurm(setup: _Setup, slurm: SlurmOptions) -> None:
    """Errors, before anything is written, for SLURM options the job would refuse."""
    for line in slurm.sbatch:
        if not line.startswith("--") or not _comment(line) == line or any(
                c.isspace() for c in line):
            raise PlannerError("bad-option", f"--sbatch {line!r} must be one sbatch option "
                               "starting with --, without spaces, e.g. --partition=gpu.")
        if line.split("=")[0] in _SLURM_PLANNED:
            raise PlannerError("bad-option", f"--sbatch {line!r}: the script sets "
                               f"{line.split('=')[0]} itself, from the plan.",
                               ["change the plan (or its hosts) instead; --constraint and "
                                "--gres take DEVICE=VALUE"])
    types = sorted({n.device_type for n in setup.layout.nodes})
    for option, given in (("--constraint", slurm.constraints), ("--gres", slurm.gres)):
        for device, value in given.items():
            if device not in types:
                near = closest(device, types)
                raise PlannerError(
                    "bad-option", f"{option} {device}={value}: the plan has no device type "
                    f"{device!r}" + (f"; did you mean {', '.join(map(repr, near))}?" if near
                                     else "."), [f"its device types are {', '.join(types)}"])
            if not _SLURM_VALUE.match(value):
                raise PlannerError("bad-option", f"{option} {device}={value!r} is not a SLURM "
                                   f"{option[2:]} (letters, digits and _.:&|*()[],+=-).")
    for node in setup.layout.nodes:
        host = _listed_host(setup.hosts, node) or node.host
        if host and not _SLURM_HOST.match(host):
            raise PlannerError("bad-hosts", f"Host {host!r} (node {node.name}) is not a name "
                               "SLURM can place a job on (letters, digits, '.', '_', '-').",
                               ["map the node to its SLURM node name with --hosts"])


def _render_sbatch(setup: _Setup, slurm: SlurmOptions) -> str:
    """A heterogeneous job (one component per device type and device count) whose one srun
    step runs a task per node: SLURM gives the hosts, and a task that fails ends the rest."""
    groups = _slurm_groups(setup)
    own_signal = not any(line.startswith("--signal") for line in slurm.sbatch)
    own_requeue = not any(line in ("--requeue", "--no-requeue") for line in slurm.sbatch)
    lines = ["#!/usr/bin/env bash"]
    for g, nodes in enumerate(groups):
        if g:
            lines.append("#SBATCH hetjob")
        first = nodes[0]
        lines += ["#SBATCH --job-name=planner", f"#SBATCH --nodes={len(nodes)}",
                  "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive"]
        if first.device_type in slurm.gres:
            lines.append(f"#SBATCH --gres={slurm.gres[first.device_type]}")
        elif not first.is_cpu:
            lines.append(f"#SBATCH --gpus-per-node={first.nproc}")
        if first.device_type in slurm.constraints:
            lines.append(f"#SBATCH --constraint={slurm.constraints[first.device_type]}")
        listed = [h for n in nodes if (h := _listed_host(setup.hosts, n) or n.host)]
        if listed:  # hosts the user gave; SLURM picks the rest
            lines.append(f"#SBATCH --nodelist={','.join(listed)}")
        if g == 0 and own_signal:
            lines.append(f"#SBATCH --signal=USR1@{STOP_BEFORE_END}")
        if g == 0 and own_requeue:
            lines.append("#SBATCH --requeue")
        lines += [f"#SBATCH {line}" for line in slurm.sbatch]
    lines += [f"# {_comment(t)}" for t in (
        f"planner launch (slurm): {len(setup.layout.nodes)} node(s) in {len(groups)} "
        "heterogeneous component(s), one per device type and device count.",
        "Submit it from anywhere: sbatch /path/to/launch.sbatch (it finds this folder from "
        "its own path); arguments go to python -m planner.runtime.",
        f"SLURM signals the ranks {STOP_BEFORE_END} s before the time limit: they checkpoint "
        "and end, and the job requeues itself to resume.")]
    lines += ["set -euo pipefail", "",
              "# this folder: the path SLURM recorded for this script (sbatch runs a copy)",
              'if [ -z "${PLANNER_LAUNCH_DIR:-}" ]; then',
              '  script=$(scontrol show job "$SLURM_JOB_ID" | sed -n "s/^ *Command=//p" '
              "| head -n 1)",
              '  case "$script" in',
              "    /*) ;;",
              '    *) script="${SLURM_SUBMIT_DIR:-$PWD}/$script" ;;',
              "  esac",
              '  PLANNER_LAUNCH_DIR=$(dirname "$script")',
              "fi",
              'HERE="$PLANNER_LAUNCH_DIR"',
              'if [ ! -f "$HERE/plan.json" ]; then',
              '  echo "launch.sbatch: no plan.json in $HERE: set PLANNER_LAUNCH_DIR to the '
              'launch folder" >&2',
              "  exit 1",
              "fi"]
    lines += [f"RUN_DIR={_run_dir_word(setup)}", 'RUN_DIR="${PLANNER_RUN_DIR:-$RUN_DIR}"']
    lines += ["", "# SLURM gives each task the GPUs it asked for", "export PLANNER_SET_DEVICES=0",
              "# node rank 0's host, the first SLURM gave the first component, is the head "
              "(the rendezvous)",
              f'HEAD=$(scontrol show hostnames "{_slurm_var("SLURM_JOB_NODELIST", 0, groups)}" '
              "| head -n 1)",
              'export PLANNER_MASTER_ADDR="$HEAD"',
              "# each component's CPUs per node: srun does not pass --cpus-per-task on to its "
              "tasks since Slurm 22.05"]
    for g in range(len(groups)):
        lines += [f'cpus{g}="{_slurm_var("SLURM_JOB_CPUS_PER_NODE", g, groups)}"',
                  f'cpus{g}="${{cpus{g}%%[(,]*}}"']
    parts = [f'--kill-on-bad-exit=1 --label --nodes={len(nodes)} --ntasks-per-node=1 '
             f'--cpus-per-task="$cpus{g}" bash "$HERE"/slurm-task.sh "$@"'
             for g, nodes in enumerate(groups)]
    lines += ["", "# one job step, a task per node (slurm-task.sh picks its node's script); a "
              "task that fails ends the others", "status=0",
              "srun " + " \\\n  : ".join(parts) + " || status=$?",
              'if [ "$status" = 0 ] && [ -f "$RUN_DIR/stopped.json" ]; then',
              '  echo "launch.sbatch: the ranks checkpointed before the time limit; requeueing '
              'the job to resume" >&2',
              '  scontrol requeue "$SLURM_JOB_ID"',
              "fi",
              'exit "$status"']
    return "\n".join(lines) + "\n"


def _slurm_var(name: str, group: int, groups: Sequence[object]) -> str:
    """A SLURM job variable of component `group` as a shell word's text: its _HET_GROUP_<g>
    form in a heterogeneous job, the plain one otherwise."""
    return f"${{{name}_HET_GROUP_{group}}}" if len(groups) > 1 else f"${{{name}}}"


def _render_slurm_task(setup: _Setup) -> str:
    """What each task of launch.sbatch's step runs: SLURM_PROCID numbers the tasks component
    by component, so it picks the node's script; the task's host is the node's address."""
    q = shlex.quote
    order = [node for nodes in _slurm_groups(setup) for node in nodes]
    lines = _preamble([
        "planner launch (slurm): one task per node of the plan, started by launch.sbatch's "
        "srun; SLURM_PROCID (tasks numbered component by component) picks its node's script."])
    lines += [f"SCRIPTS=({' '.join(q(node_script(n)) for n in order)})",
              'script="${SCRIPTS[$SLURM_PROCID]}"',
              "# the address the other nodes reach this one at: its SLURM node name",
              'PLANNER_LOCAL_ADDR="${SLURMD_NODENAME:-$(hostname)}"',
              "export PLANNER_LOCAL_ADDR",
              'exec bash "$HERE/$script" "$@"']
    return "\n".join(lines) + "\n"


def _ssh_lines(setup: _Setup, folder: str | None) -> list[str]:
    """The README's commands that start every node's script on its host, all at once: each
    cds into the launch folder there (ssh runs a command in the home folder)."""
    q = shlex.quote
    where = q(folder) if folder else "$DIR"
    lines = [] if folder else ["    DIR=/path/to/this/folder  # where it is on every host"]
    for node in setup.layout.nodes:
        remote = f"cd {where} && bash {q(node_script(node))}"
        lines.append(f"    ssh -- {q(str(setup.host(node).host))} "
                     + (q(remote) if folder else f'"{remote}"')
                     + f" > {q(node_script(node)[:-3] + '.log')} 2>&1 &")
    return [*lines, "    wait"]


def _readme(setup: _Setup, target: str, files: Sequence[str],
            folder: str | None = None, *, supervise: SuperviseOptions | None = None) -> str:
    plan, layout = setup.plan, setup.layout
    rows = []
    for node in layout.nodes:
        entry = setup.host(node)
        host, address = ("this machine", "127.0.0.1") if target == "local" else (
            entry.host, entry.address)
        last = node.first_rank + node.nproc - 1
        ranks = str(last) if last == node.first_rank else f"{node.first_rank}-{last}"
        rows.append(f"| {node.node_rank} | {node.name} | {host} | {address} | "
                    f"{node.device_type} | {','.join(map(str, node.devices))} | {ranks} | "
                    f"`{'run-local.sh' if target == 'local' else node_script(node)}` |")
    what = {
        "torchrun": ("Put this folder at the same path on every host (a shared file system, "
                     "or a copy), then run every node's script on its host, in any order, "
                     f"within {setup.rendezvous_timeout} s of each other: they meet at node "
                     f"rank 0's {setup.master.address}:{setup.port} (a node that never comes "
                     "is named), then torchrun's c10d rendezvous. From here, all at once:"
                     "\n\n" + "\n".join(_ssh_lines(setup, folder))),
        "slurm": ("On the login node: `sbatch launch.sbatch` (from any folder: it finds this "
                  "one from its own path). A heterogeneous job, one component per device type "
                  "and count below, runs one srun step with a task per node; SLURM picks the "
                  "hosts (the table's, where `--hosts` named them) and assigns the GPUs, and "
                  "node rank 0's host is the head. A task that fails ends the others. "
                  f"{STOP_BEFORE_END} s before the time limit the ranks checkpoint, end, and "
                  "the job requeues itself to resume."),
        "local": ("On this machine: `bash run-local.sh`. Every node of the plan gets its own "
                  "launcher and torchrun on 127.0.0.1, on the CPU with gloo; logs go to "
                  "`logs/`."),
    }[target]
    restarts = (f"When a rank fails, every node's ranks restart together, up to "
                f"{setup.max_restarts} time(s), and resume from the newest intact checkpoint "
                "in the run directory (`--resume`), so a crash loses at most the steps since "
                "the last checkpoint (`--checkpoint-every K`)." if setup.max_restarts else
                "No restarts (`planner launch --max-restarts N` adds them).")
    failed = ("When the run fails, each node's output ends with the rank that failed first "
              "and why (`failures/` in the run directory holds each node's record), and "
              "each rank's output is in `logs/` there.")
    supervised = [] if supervise is None else [
        "Supervised: `bash supervise.sh` does the above and watches the run. When a node is "
        "lost (its launcher ended without a word, or its ranks were killed and torchrun's "
        "restarts did not bring them back) it re-plans on the nodes left (`planner replan`: "
        "the surviving pipelines rebalanced, or a search of at most "
        f"{supervise.time_limit:g} s, the global batch kept), writes the new plan's scripts "
        "into `replan-N/` here, and resumes from the newest checkpoint, up to "
        f"{supervise.max_replans} time(s); `supervisor.jsonl` in the run directory says what "
        "it did. A rank that failed on its own (an error, a NaN) stops it: a new plan would "
        "fail alike.", ""]
    return "\n".join([
        f"# Launch: {plan.model.describe()} on {plan.cluster.name}", "",
        f"Target `{target}`: {layout.world_size} rank(s) on {len(layout.nodes)} node(s), "
        f"{len(plan.pipelines)} pipeline(s), global batch {plan.training.global_batch}, "
        f"{plan.training.dtype}; predicted step time {plan.prediction.step_time:.4g} s.", "",
        what, "", *supervised,
        "| node rank | node | host | address | device | devices | ranks | script |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        "Each rank checks its environment against `plan.json` before doing anything "
        "(world size, node rank, local rank, device type) and says what it expected and "
        "found. Environment overrides: PLANNER_PLAN, PLANNER_RUN_DIR, PLANNER_PYTHON, "
        "PLANNER_MASTER_PORT, PLANNER_RDZV_TIMEOUT (seconds the nodes wait for each other), "
        "PLANNER_MASTER_ADDR (node rank 0's address); arguments after a script's name go to "
        "`python -m planner.runtime` (see `python -m planner.runtime --help`).", "",
        "Checkpoints, `losses.jsonl` and `summary.json` go to the run directory "
        f"({f'`{setup.run_dir}`' if setup.run_dir else '`run/` in this folder'} unless "
        "PLANNER_RUN_DIR is set), which "
        "every node must see at the same path (a shared file system). " + restarts, "",
        failed, "",
        "Files: " + ", ".join(f"`{f}`" for f in files) + ".", ""])


def render_launch(plan: Plan, *, target: str, hosts: Mapping[str, HostEntry] | None = None,
                  master_port: int = DEFAULT_PORT, max_restarts: int = 0,
                  runtime_args: Sequence[str] = (), python: str = "python3",
                  run_dir: str | None = None, sbatch: Sequence[str] = (),
                  constraints: Mapping[str, str] | None = None,
                  gres: Mapping[str, str] | None = None,
                  rendezvous_timeout: int = DEFAULT_RENDEZVOUS_TIMEOUT,
                  folder: str | None = None,
                  supervise: SuperviseOptions | None = None) -> dict[str, str]:
    """{file name: text} of the launch files for `plan` (see the module docstring);
    `folder` is where they will be (for the README's commands), `constraints` and `gres`
    map device types to SLURM's --constraint and --gres; `supervise` adds supervise.sh and
    launch.json (these options, for the supervisor to write a new plan's files alike).
    Pure: reads and writes nothing."""
    if target not in TARGETS:
        raise PlannerError("bad-option", f"--target {target!r} is not one of "
                           f"{', '.join(TARGETS)}.")
    if not 0 < master_port < 65536:
        raise PlannerError("bad-option", f"--master-port {master_port} is not a TCP port.")
    if max_restarts < 0:
        raise PlannerError("bad-option", f"--max-restarts must be 0 or more (got "
                           f"{max_restarts}).")
    if rendezvous_timeout < 1:
        raise PlannerError("bad-option", f"--rendezvous-timeout must be at least 1 second "
                           f"(got {rendezvous_timeout}).")
    if run_dir is not None and (not run_dir.strip() or not run_dir.isprintable()):
        raise PlannerError("bad-option", f"--run-dir {run_dir!r} is not a folder name: the "
                           "runs write checkpoints, logs and the summary there.",
                           ["give a folder, e.g. --run-dir /scratch/run",
                            "or leave it out (run/ in the --out folder)"])
    layout = rank_layout(plan)
    hosts = dict(hosts or {})
    _check_hosts(plan, layout, hosts)
    args = tuple(runtime_args)
    if (max_restarts or target == "slurm" or supervise) and "--resume" not in args:
        args = (*args, "--resume")  # (a requeued SLURM job resumes too, and a re-planned run)
    if supervise is not None and supervise.max_replans < 0:
        raise PlannerError("bad-option", f"--max-replans must be 0 or more (got "
                           f"{supervise.max_replans}).")
    if supervise is not None and not supervise.time_limit >= 0:
        raise PlannerError("bad-option", f"--replan-time-limit must be 0 or more seconds (got "
                           f"{supervise.time_limit:g}).")
    setup = _Setup(plan=plan, layout=layout, hosts=hosts, port=master_port,
                   max_restarts=max_restarts, runtime_args=args, python=python,
                   run_dir=run_dir, rendezvous_timeout=rendezvous_timeout)
    slurm = SlurmOptions(sbatch=tuple(sbatch), constraints=dict(constraints or {}),
                         gres=dict(gres or {}))
    if target != "local":
        _check_plan_hosts(setup)
        _check_one_node_per_host(setup)
    if target == "slurm":
        _check_slurm(setup, slurm)
    files: dict[str, str] = {"plan.json": plan_json(plan)}
    scripts: dict[str, str] = {}
    if target == "local":
        scripts["run-local.sh"] = _render_local(setup)
    else:
        for node in layout.nodes:
            scripts[node_script(node)] = _render_node(setup, node)
        if target == "slurm":
            scripts["launch.sbatch"] = _render_sbatch(setup, slurm)
            scripts["slurm-task.sh"] = _render_slurm_task(setup)
    if supervise is not None:
        scripts["supervise.sh"] = _render_supervise(setup, target, supervise)
        files["launch.json"] = json.dumps({
            "kind": "launch", "schema_version": 1, "target": target,
            "hosts": {name: dataclasses.asdict(entry) for name, entry in hosts.items()},
            "master_port": master_port, "max_restarts": max_restarts,
            "runtime_args": list(args), "python": python, "run_dir": run_dir,
            "sbatch": list(slurm.sbatch), "constraints": dict(slurm.constraints),
            "gres": dict(slurm.gres), "rendezvous_timeout": rendezvous_timeout,
            "supervise": dataclasses.asdict(supervise)}, indent=1) + "\n"
    files.update({name: _literal_note(text) for name, text in scripts.items()})
    files["README.md"] = _readme(setup, target, [*files, "README.md"], folder,
                                 supervise=supervise)
    return files


def read_launch(path: Path) -> dict[str, Any]:
    """The keyword arguments of `render_launch` that launch.json (written with
    `supervise`) records, for a new plan's files."""
    try:
        data = json.loads(path.read_text())
        options = {key: data[key] for key in (
            "target", "master_port", "max_restarts", "runtime_args", "python", "run_dir",
            "sbatch", "constraints", "gres", "rendezvous_timeout")}
        options["hosts"] = parse_hosts(data["hosts"], str(path)) if data["hosts"] else {}
        options["supervise"] = SuperviseOptions(**data["supervise"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PlannerError("bad-launch", f"{path} cannot be read as the record `planner launch "
                           f"--supervise` writes ({type(exc).__name__}: {exc}).",
                           ["write the launch folder again with planner launch --supervise"]
                           ) from None
    return options


def _render_supervise(setup: _Setup, target: str, supervise: SuperviseOptions) -> str:
    """supervise.sh: the supervisor for this folder (`runtime/supervise.py`)."""
    how = {"local": "bash run-local.sh", "torchrun": "every node's script over ssh, all at once",
           "slurm": "sbatch --wait launch.sbatch"}[target]
    lines = _preamble([
        f"planner launch: the supervisor. It runs this folder's plan ({how}); when a node is "
        "lost it re-plans on the nodes left, writes their scripts into replan-N/ here and "
        "resumes from the newest checkpoint.",
        f"At most {supervise.max_replans} re-plan(s), each searching for at most "
        f"{supervise.time_limit:g} s; arguments go to python -m planner.runtime.supervise."])
    lines += [f"PYTHON={shlex.quote(setup.python)}", 'PYTHON="${PLANNER_PYTHON:-$PYTHON}"',
              f'exec "$PYTHON" -m planner.runtime.supervise --folder "$HERE" '
              f'--max-replans {supervise.max_replans} --time-limit {supervise.time_limit:g} '
              '"$@"']
    return "\n".join(lines) + "\n"


def check_model(plan: Plan, model: Any, source: str = "") -> None:
    """Refuse, before any file is written, a plan its ranks would refuse, naming `source`
    (the plan file): a stage naming a module `model` (the plan's model, built on meta)
    lacks, stages that no longer match the model's layers (the rule `planner explain`
    applies, `explain.retrace`), and a model the runtime cannot run (its own check,
    `runtime.stage.inspect_model`: one module per layer, called in a chain, a loss)."""
    from planner.explain import retrace
    from planner.runtime.stage import check_modules, inspect_model

    check_modules(plan, model, source)
    retrace(plan, source)
    try:
        inspect_model(plan)
    except PlannerError as exc:
        raise PlannerError(exc.kind, (f"{source}: " if source else "") + "The runtime cannot "
                           f"run this plan: {exc.message}", exc.remedies) from None


def check_out(out: Path, *, force: bool) -> None:
    """A clear error, before any work is done, where the files cannot or may not be written
    into folder `out`: an existing folder needs `force`; a new one is made where the first
    missing folder of its path can be (the check `planner solve -o` makes of a file)."""
    if out.exists() and not out.is_dir():
        raise PlannerError("bad-path", f"{str(out)!r} is a file, not a folder.",
                           ["choose another --out folder"])
    if out.exists() and not force:
        raise PlannerError("file-exists", f"{str(out)!r} already exists; it was left as it is.",
                           ["pass --force to overwrite the files in it",
                            "choose another --out folder"])
    if out.is_dir():
        check_writable(out / "README.md", force=True)
        return
    created = out  # the first folder of the path that does not exist yet
    while not created.parent.exists() and created.parent != created:
        created = created.parent
    check_writable(created, force=force)


def write_launch(files: Mapping[str, str], out: Path, *, force: bool = False) -> list[Path]:
    """Write the files into `out` (created); an existing `out` needs `force`. A folder or
    file that cannot be written is a PlannerError (`check_out`), never an OSError."""
    check_out(out, force=force)
    written = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = out / name
            path.write_text(text)
            if name.endswith((".sh", ".sbatch")):
                path.chmod(0o755)
            written.append(path)
    except OSError as exc:  # what the check cannot foresee: a read-only file, a full disk
        raise PlannerError("bad-path", f"{str(exc.filename or out)!r} cannot be written "
                           f"({exc.strerror or exc}); {len(written)} of the {len(files)} files "
                           f"were written to {str(out)!r}.", ["choose another --out folder"]
                           ) from None
    return written
