"""Processes started inside ``children_die_with_us`` die with their parent: real
processes, no model. The program that starts them is a plain script of its own, not
the CLI, so the marking that reaches a spawned child is vLLM's plugin hook alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from importlib.metadata import entry_points
from pathlib import Path

import psutil

from llmbatch.engine import parent_death

# A parent entering the block and spawning a child as vLLM starts EngineCore on CPU
# (multiprocessing's spawn method); the child loads vLLM's general plugins, as
# EngineCore does before it builds anything, says its parent-death signal and sleeps.
PARENT = """
import ctypes, multiprocessing, sys, time

def child(out):
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    signal = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(signal), 0, 0, 0)  # PR_GET_PDEATHSIG
    with open(out, "w") as f:
        f.write(str(signal.value))
    time.sleep(600)

if __name__ == "__main__":
    from llmbatch.engine.parent_death import children_die_with_us

    with children_die_with_us():
        process = multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1],))
        process.start()
    print(process.pid, flush=True)
    time.sleep(600)
"""


def test_the_marking_is_a_vllm_general_plugin() -> None:
    (plugin,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.name == parent_death.VLLM_PLUGIN
    ]
    assert plugin.load() is parent_death.mark_if_started_by_us


def test_a_spawned_child_of_any_program_dies_when_its_parent_is_sigkilled(
    tmp_path: Path,
) -> None:
    script, out = tmp_path / "parent.py", tmp_path / "signal"
    script.write_text(textwrap.dedent(PARENT))
    parent = subprocess.Popen(
        [sys.executable, str(script), str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 120  # importing vLLM, on a loaded machine
        while not out.exists() or not out.read_text():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.1)
        assert out.read_text() == str(int(signal.SIGKILL))
        parent.kill()
        parent.wait()
        child.wait(10)  # raises if it outlives its parent
    finally:
        parent.kill()
        parent.wait()


def _mark(creator: int | None) -> subprocess.CompletedProcess[str]:
    """A process whose environment names ``creator`` (None: itself) as the one that
    started it marks itself, then prints its parent-death signal and whether it
    names itself for its children."""
    return subprocess.run(
        [sys.executable, "-c",
         "import ctypes, os\n"
         "from llmbatch.engine import parent_death\n"
         "os.environ.setdefault(parent_death.ENV, str(os.getpid()))\n"
         "parent_death.mark_if_started_by_us()\n"
         "signal = ctypes.c_int()\n"
         "ctypes.CDLL(None).prctl(2, ctypes.byref(signal), 0, 0, 0)\n"
         "print(signal.value, os.environ[parent_death.ENV] == str(os.getpid()))"],
        env={**os.environ, **({} if creator is None else {parent_death.ENV: str(creator)})},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip


def test_a_child_dies_with_its_parent_and_names_itself_for_its_own_children() -> None:
    marked = _mark(os.getpid())
    assert (marked.returncode, marked.stdout) == (0, f"{int(signal.SIGKILL)} True\n")


def test_a_child_whose_creator_died_before_it_could_mark_itself_ends() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    marked = _mark(gone.pid)
    assert (marked.returncode, marked.stdout) == (1, "")


def test_the_creator_itself_is_not_marked() -> None:
    marked = _mark(None)
    assert (marked.returncode, marked.stdout) == (0, "0 True\n")
