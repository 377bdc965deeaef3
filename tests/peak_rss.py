"""Peak memory of one command, measured in a fresh process (the tests of hostile inputs' memory bounds)."""

import os
import pathlib
import subprocess
import sys

from hang import HANG_SEC

WORKFLOW_DPATH = pathlib.Path(__file__).resolve().parents[1] / "workflow"
RSS_WRAPPER = """\
import resource, subprocess, sys
rc = subprocess.run(sys.argv[2:]).returncode
with open(sys.argv[1], "w") as fd:
    fd.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(rc)
"""


def run_measured(argv: list[str], cwd: pathlib.Path) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak RSS bytes) of one fresh process.

    A child inherits its parent's peak RSS across fork and exec on Linux, so the command runs under a tiny wrapper
    process (not under pytest, whose own peak would be reported) that reports RUSAGE_CHILDREN after it exits.
    """
    env = {**os.environ, "PYTHONPATH": str(WORKFLOW_DPATH)}
    rss_fpath = cwd / "peak_rss_bytes"
    wrapped = [sys.executable, "-S", "-c", RSS_WRAPPER, str(rss_fpath), *argv]
    proc = subprocess.run(wrapped, cwd=cwd, capture_output=True, text=True, env=env, timeout=HANG_SEC)
    peak_bytes = int(rss_fpath.read_text())
    rss_fpath.unlink()
    return proc.returncode, proc.stdout, proc.stderr, peak_bytes
