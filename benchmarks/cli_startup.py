"""CPU time of the CLI's start: ``llm-batch --help`` and ``llm-batch status JOB``.

Each command runs ``--runs`` times in a fresh process, after one uncounted run that
writes the bytecode caches an installed wheel has (with PYTHONDONTWRITEBYTECODE
unset); its user + system CPU seconds come from the kernel's accounting of the
finished child (``getrusage``, what ``/usr/bin/time -f '%U %S'`` prints). Printed as
medians, beside the peer: a bare Typer app of two commands printing its help, which
is what Python, typer and rich cost before llm-batch adds anything.

``status`` asks Temporal for the job: with no stack running it stops at the refused
connection, which is the start (imports, settings, client) without the round trips;
with ``--job`` of a real job on a running stack it is the whole command.

    .venv/bin/python benchmarks/cli_startup.py --runs 5
    .venv/bin/python benchmarks/cli_startup.py --exe /other/checkout/.venv/bin/llm-batch
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

PEER = """
import typer
app = typer.Typer()
@app.command()
def one(x: int = 1) -> None:
    "One."
@app.command()
def two(x: int = 1) -> None:
    "Two."
app()
"""


# Bytecode is written and read, as it is for an installed package.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def cpu_seconds(argv: list[str]) -> float:
    """User + system CPU seconds of one run of ``argv`` (and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=ENV)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def median_of(argv: list[str], runs: int) -> dict[str, object]:
    cpu_seconds(argv)  # writes the bytecode caches
    samples = [cpu_seconds(argv) for _ in range(runs)]
    return {
        "median_s": round(statistics.median(samples), 3),
        "runs_s": [round(s, 3) for s in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--exe",
        type=Path,
        default=Path(sys.executable).with_name("llm-batch"),
        help="The llm-batch console script to measure (default: this environment's).",
    )
    parser.add_argument("--job", default="no-such-job", help="The job id status asks for.")
    args = parser.parse_args()
    exe = str(args.exe)
    found = {
        "llm-batch --help": median_of([exe, "--help"], args.runs),
        f"llm-batch status {args.job}": median_of([exe, "status", args.job], args.runs),
        "peer: a bare typer app's --help": median_of(
            [sys.executable, "-c", PEER, "--help"], args.runs
        ),
    }
    print(json.dumps({"exe": exe, "runs": args.runs, "cpu_s": found}, indent=2))


if __name__ == "__main__":
    main()
