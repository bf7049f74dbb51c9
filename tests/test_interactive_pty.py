"""`planner` alone in a real terminal (a pty, through pexpect): the guided start, a
what-if, saving, and Ctrl-C leaving cleanly with the saved files intact."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from planner.planfile import read_plan

pexpect = pytest.importorskip("pexpect")
ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")]


def spawn(cwd: Path, *args: str):
    env = dict(os.environ, NO_COLOR="1", COLUMNS="120", LINES="60", TERM="xterm",
               PYTHONPATH=str(ROOT))
    # Ctrl-C as a terminal has it, even where the tests run with SIGINT ignored (a shell
    # runs a background job so, and the child would inherit that)
    child = pexpect.spawn(sys.executable, ["-m", "cli.main", *args], cwd=str(cwd), env=env,
                          encoding="utf-8", timeout=90, dimensions=(60, 120),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.logfile_read = (cwd / "terminal.log").open("w")
    return child


def answer(child, prompt: str, text: str) -> None:
    child.expect(prompt)
    child.sendline(text)


def test_guided_session_load_solve_whatif_save(tmp_path):
    child = spawn(tmp_path)
    answer(child, r"Model[^\n]*gpt-tiny", "gpt-tiny")
    answer(child, r"Shape overrides", "--layers 2")
    answer(child, r"Cluster[^\n]*e/f/b/i", "b")
    answer(child, r"Device type", "search a100")
    answer(child, r"Device type", "A100-80G")
    answer(child, r"How many A100-80G-SXM nodes", "1")
    answer(child, r"devices per node", "4")
    answer(child, r"Add another kind of node", "y")
    answer(child, r"Device type", "V100-32G")
    answer(child, r"How many V100-32G nodes", "1")
    answer(child, r"devices per node", "4")
    answer(child, r"Add another kind of node", "n")
    answer(child, r"Network between nodes", "50 Gbit")  # a typo asks this question again
    child.expect(r"did you mean '50 Gbit/s'\?")
    answer(child, r"Network between nodes", "50Gbps")
    answer(child, r"Global batch", "32")
    answer(child, r"Sequence length", "")
    answer(child, r"Training dtype", "")
    child.expect("Prediction")  # the first plan
    answer(child, "planner>", "add 1x4xV100-32G")
    child.expect("What changed")
    child.expect("`show plan`: the whole plan")  # a what-if shows the plan compactly
    answer(child, "planner>", "constrain max-tp=1")
    child.expect("Constraints: max-tp=1")
    answer(child, "planner>", "save plan plan.json")
    child.expect("Saved the plan")
    answer(child, "planner>", "save transcript session.txt")
    child.expect("Saved the transcript")
    child.expect("planner>")
    time.sleep(0.5)  # let the prompt start reading: a ^C before that can be lost on a busy box
    child.sendintr()  # Ctrl-C at the prompt leaves
    child.expect(pexpect.EOF)
    child.close()
    log = (tmp_path / "terminal.log").read_text()
    assert child.exitstatus == 130, log[-2000:]
    assert "Left the session (Ctrl-C)" in log and "Traceback" not in log
    plan = read_plan(tmp_path / "plan.json")
    assert plan.cluster.num_devices == 12 and dict(plan.model.overrides) == {"layers": 2}
    lines = (tmp_path / "session.txt").read_text().splitlines()
    assert "cluster 1x4xA100-80G-SXM,1x4xV100-32G@50Gbps" in lines
    assert lines[-3:] == ["add 1x4xV100-32G", "constrain max-tp=1", "save plan plan.json"]


def test_ctrl_c_during_the_questions_and_ctrl_d_at_the_prompt(tmp_path):
    child = spawn(tmp_path)
    child.expect(r"Model")
    time.sleep(0.5)  # let the question start reading: a ^C before that can be lost
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    child = spawn(tmp_path, "interactive", "-m", "gpt-tiny", "-c", "1x2xA100-80G",
                  "-B", "8", "--no-guided")
    answer(child, "planner>", "solve")
    child.expect("Prediction")
    child.expect("planner>")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    log = (tmp_path / "terminal.log").read_text()
    assert child.exitstatus == 0 and "Left the session (end of input)" in log
