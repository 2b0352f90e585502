"""SIGINT in a worker: a KeyboardInterrupt in the cell's code, as in a kernel.

The host interrupts a cell by sending SIGINT to the worker's process group (as
jupyter_client does, so that a ``!cmd`` child stops too). The worker must raise
only inside the cell's code: a KeyboardInterrupt while it writes a frame to the
host would cut the frame in half, and one during a restore or a save would lose
the session's state. So the signal is ignored outside a run, and deferred while
the worker does its own work during a run (before the cell's code starts, while
it sends an output or fetches a name) until it is back in the cell's code.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager


class CellInterrupts:
    def __init__(self) -> None:
        self.in_run = False
        self.shielded = 0
        self.pending = False

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        if not self.in_run:
            return  # restore, save or idle: the host interrupts runs only
        if self.shielded:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def run(self):
        """While the worker serves a run: interrupts are deferred except inside
        ``cell``; one that arrived before the cell's code started raises there."""
        self.in_run, self.shielded, self.pending = True, 1, False
        try:
            yield
        finally:
            self.in_run, self.shielded, self.pending = False, 0, False

    @contextmanager
    def cell(self):
        """While the cell's code runs."""
        self.shielded -= 1
        try:
            if self.pending and not self.shielded:
                self.pending = False
                raise KeyboardInterrupt
            yield
        finally:
            self.shielded += 1

    @contextmanager
    def shield(self):
        """While the worker exchanges a frame with the host mid-cell: an interrupt
        waits until the exchange is complete."""
        self.shielded += 1
        try:
            yield
        finally:
            self.shielded -= 1
        if not self.shielded and self.pending and self.in_run:
            self.pending = False
            raise KeyboardInterrupt
