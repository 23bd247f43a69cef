"""`cachelane locust ...` (or `python -m loadtest.locust ...`): Locust on the scenarios of the
installed package, from any directory, no checkout needed.

    cachelane locust --headless -u 20 -r 5 -t 60s --host http://127.0.0.1:8000
    cachelane locust --shapes --headless --host http://127.0.0.1:8000   # with the load shapes
    cachelane locust --help                # Locust's options, then ours: --model, --seed, keys
    cachelane locust --worker --master-host 10.0.0.1                  # a distributed worker
    locust -f "$(cachelane locust --print-path)" ...                  # Locust itself, same files

Every argument goes to Locust, with `-f` set to this package's locustfile.py (and shapes.py
with `--shapes`). Locust runs in a process of its own (the current one is replaced), as the
`locust` command would: importing it monkey-patches the standard library with gevent.

`--help` lists Locust's options and the scenarios' own (`locust -f locustfile.py --help` cannot:
Locust prints its help before it imports the locustfile, whose options it therefore never sees).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
SHAPES = Path(__file__).with_name("shapes.py")
OWN_FLAGS = ("--shapes", "--print-path")
HELP_FLAGS = ("-h", "--help")
HELP_PROGRAM = "from loadtest.locust.run import print_help; print_help()"
LOCUSTFILE_FLAGS = ("-f", "--locustfile")


def locustfiles(shapes: bool) -> str:
    """Locust's -f value: the locustfile, and the shapes beside it."""
    return ",".join(str(p) for p in (LOCUSTFILE, *([SHAPES] if shapes else [])))


def locust_command(argv: Sequence[str]) -> list[str]:
    """The command that runs Locust on the package's scenarios with `argv` (ours removed)."""
    files = locustfiles("--shapes" in argv)
    rest = [a for a in argv if a not in OWN_FLAGS]
    return [sys.executable, "-m", "locust", "-f", files, *rest]


def main(argv: Sequence[str]) -> int:
    if any(a in LOCUSTFILE_FLAGS or a.startswith("--locustfile=") for a in argv):
        print(
            "cachelane locust: -f is set to the package's locustfile; run `locust -f ...` "
            "for another one",
            file=sys.stderr,
        )
        return 2
    if "--print-path" in argv:
        print(locustfiles("--shapes" in argv))
        return 0
    if any(a in HELP_FLAGS for a in argv):
        command = [sys.executable, "-c", HELP_PROGRAM]
    else:
        command = locust_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)  # never returns


def print_help() -> None:
    """Locust's help with the scenarios' options in it (run in a process of its own)."""
    from locust.argument_parser import get_parser

    import loadtest.locust.locustfile  # noqa: F401  (registers the options' listener)

    parser = get_parser()  # fires init_command_line_parser: the scenarios add their options
    parser.description = "Usage: cachelane locust [options] [UserClass ...]"
    own = parser.add_argument_group("cachelane locust")
    own.add_argument("--shapes", action="store_true", help="load the load shapes (shapes.py) too")
    own.add_argument(
        "--print-path", action="store_true", help="print the -f value (the files) and exit"
    )
    parser.print_help()
