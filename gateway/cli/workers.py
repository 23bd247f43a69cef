"""`cachelane serve --workers N`: uvicorn's supervisor, except for SIGHUP.

uvicorn's Multiprocess answers SIGHUP by replacing every worker process, which would drop each
worker's embedded index and load counts. Here SIGHUP is passed on to every worker instead, and
each reloads the config file in place (gateway/fleet/reload.py), as a single process does: the
processes, and with them the index, stay.
"""

from __future__ import annotations

import logging
import os
import signal

import uvicorn
from uvicorn.supervisors import Multiprocess

log = logging.getLogger("cachelane.workers")


class ReloadingWorkers(Multiprocess):
    """uvicorn's supervisor, with SIGHUP passed on to the workers rather than restarting them."""

    def handle_hup(self) -> None:
        pids = [p.pid for p in self.processes if p.pid is not None]
        log.info("SIGHUP: each of %d workers reloads the config file in place", len(pids))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGHUP)
            except ProcessLookupError:  # exited meanwhile: the supervisor replaces it
                continue


def run_workers(config: uvicorn.Config) -> None:
    """Serve `config` (an import string, workers > 1) with ReloadingWorkers, as uvicorn.run does
    with its own supervisor."""
    sock = config.bind_socket()
    try:
        ReloadingWorkers(config, sockets=[sock]).run()
    finally:
        sock.close()
