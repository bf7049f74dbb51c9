"""What the benchmarks that run plans on this machine share: the planner CLI as a
subprocess, and a plan's local launch run to its summary (launch_e2e.py, sync.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANNER = [sys.executable, "-m", "cli.main"]


def env() -> dict[str, str]:
    """One thread per rank, the checkout importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def planner(*args: str, cpus: str | None = None) -> str:
    """Run `planner ARGS` (pinned to `cpus` where given); its stdout, or exit with its
    output where it fails."""
    pin = ["taskset", "-c", cpus] if cpus else []
    result = subprocess.run([*pin, *PLANNER, *args], cwd=ROOT, env=env(),
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"planner {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def run_local(out: Path) -> dict:
    """Run a launch folder's run-local.sh; the run's summary.json, or exit with the ranks'
    logs where it fails."""
    result = subprocess.run(["bash", str(out / "run-local.sh")], capture_output=True,
                            text=True, env=env())
    if result.returncode:
        logs = "".join(p.read_text()[-4000:] for p in (out / "logs").glob("*.log"))
        raise SystemExit(f"run-local.sh failed:\n{result.stdout}{result.stderr}{logs}")
    return json.loads((out / "run" / "summary.json").read_text())
