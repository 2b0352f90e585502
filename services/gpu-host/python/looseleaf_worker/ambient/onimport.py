"""Library state applied when a cell first imports the library (a meta path
finder that runs a callback right after the import), carried until then."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Any

from .. import quiet


class _OnImport:
    """A meta path finder that runs a callback right after a module's first import
    in this worker. A library's saved state (its RNG, its options) matters only
    once a cell uses the library, so a worker whose zygote lacks it does not
    import it at restore (matplotlib ~80 ms, torch ~1 s): the state is applied
    when the cell imports it. Until then the saved entries are carried into this
    worker's own saves (``unapplied``), so no later worker loses them."""

    # Its instance sits in sys.meta_path, where a variable may hold it: a saved
    # record names the class by its module before ambient became a package,
    # which re-exports it under that name.
    __module__ = "looseleaf_worker.ambient"

    def __init__(self):
        self.pending: dict[str, tuple[Any, dict]] = {}  # module -> (callback, saved entries)
        self._finding: set[str] = set()

    def unapplied(self) -> dict:
        """The saved entries of the libraries no cell has imported yet."""
        out: dict = {}
        for name, (_, entries) in self.pending.items():
            if name not in sys.modules:
                out.update(entries)
        return out

    def find_spec(self, name, path, target=None):
        if name not in self.pending or name in self._finding:
            return None
        self._finding.add(name)
        try:
            spec = importlib.util.find_spec(name)  # the other finders (ours passes now)
        finally:
            self._finding.discard(name)
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # a class as loader (builtins, frozen) is shared: never patched
        load = loader.exec_module

        def exec_module(module):
            if module.__name__ != name:  # a loader shared by several modules
                return load(module)
            try:
                load(module)
            finally:
                with contextlib.suppress(AttributeError):
                    del loader.exec_module  # the instance's own method again
            # imported: from here the library's live state is what saves read
            then = self.pending.pop(name, (None, None))[0]
            if then is not None:
                _guarded(then, module)

        # on this loader instance only: its class (and resource reading) stay as
        # they are; one that takes no attributes imports as usual (its state is
        # carried, not applied)
        with contextlib.suppress(AttributeError, TypeError):
            loader.exec_module = exec_module
        return spec


def _guarded(fn, module) -> None:
    # inside a cell's import: a failure must not fail the user's import
    try:
        fn(module)
    except Exception as e:  # noqa: BLE001 - one library's state lost, not the import
        quiet.log(f"looseleaf worker: could not restore {module.__name__} state: {type(e).__name__}: {e}")


def _on_import() -> _OnImport:
    hook = next((f for f in sys.meta_path if isinstance(f, _OnImport)), None)
    if hook is None:
        hook = _OnImport()
        sys.meta_path.insert(0, hook)
    return hook


def when_imported(name: str, fn, entries: dict) -> None:
    """Call ``fn(module)`` now if ``name`` is imported (its errors are the
    restore's), else right after a cell first imports it; ``entries``: the saved
    state ``fn`` applies, carried into saves until then."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
        return
    hook = _on_import()
    if name in hook.pending:  # several kinds of state of one library: each applies
        first, carried = hook.pending[name]

        def both(module, first=first, then=fn):
            _guarded(first, module)
            then(module)

        fn, entries = both, {**carried, **entries}
    hook.pending[name] = (fn, entries)
