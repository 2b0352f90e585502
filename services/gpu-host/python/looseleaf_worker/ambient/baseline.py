"""The baseline: what the worker looked like before any cell ran; ambient state
is the difference from it."""

from __future__ import annotations

import os
import sys

from .hooks import _printer_key, _watch_cells
from .settings import _settings
from .stdlib import builtins_baseline, logging_baseline, umask


class Baseline:
    """What the worker looked like before any cell ran (diffs are against it)."""

    def note_env(self) -> None:
        """Take the environment as it is now for the baseline's."""
        self.env = dict(os.environ)
        # os.environ's own bytes mapping, where this Python has one: comparing it
        # tells "no cell changed the environment" without decoding every variable
        self.env_bytes = dict(getattr(os.environ, "_data", {})) or None

    def adopt_env(self, env: dict[str, str]) -> None:
        """Variables the host set (a slot's devices) are the baseline's too."""
        self.env.update(env)
        if self.env_bytes is not None:
            key, value = os.environ.encodekey, os.environ.encodevalue
            self.env_bytes.update({key(k): value(v) for k, v in env.items()})

    def __init__(self, shell):
        self.note_env()
        self.path = list(sys.path)
        self.np_print = self.np_err = None
        if "numpy" in sys.modules:
            self.np_print = sys.modules["numpy"].get_printoptions()
            self.np_err = sys.modules["numpy"].geterr()
        self.recursion_limit = sys.getrecursionlimit()
        self.logging = logging_baseline()
        self.builtins = builtins_baseline()
        self.argv = list(sys.argv)
        self.umask = umask()
        mm = shell.magics_manager.magics
        self.magics = {kind: dict(mm[kind]) for kind in ("line", "cell")}
        shell._ll_base = self
        _watch_cells(shell)
        self.settings = _settings(shell)
        self.events = {k: list(v) for k, v in shell.events.callbacks.items()}
        self.formatters = {
            mime: (dict(f.type_printers), dict(f.deferred_printers))
            for mime, f in shell.display_formatter.formatters.items()
        }
        self.printers = {
            (mime, _printer_key(k), id(p))
            for mime, (types_, deferred) in self.formatters.items()
            for k, p in [*types_.items(), *deferred.items()]
        }
