"""Running a benchmark's (or the demo's) command as a user would, in a child Python."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence


def run_ok(args: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`python <args>`, bounded by `timeout_s`; asserts it exited 0, with its output if not."""
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done
