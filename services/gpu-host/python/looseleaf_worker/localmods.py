"""The session's own modules: packages and modules beside the notebook.

A plain kernel imports ``helpers/plot_lib.py`` from the notebook's folder (its
``sys.path`` starts with ``''``) and keeps the module in ``sys.modules``: later
cells see it as it was imported, even if the file changes on disk, until the
notebook reloads it. A LooseLeaf session spans many workers, so the session
keeps each such module's source as it last imported it (ambient state), and
every later worker imports it from that source, not from the disk.

A module is *local* when its source file lies in the working directory or in a
``sys.path`` entry the notebook added (not in the worker's baseline path, where
the installed libraries are). Local modules are never frozen into a zygote:
zygotes do not have the working directory on their path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass

from . import workdir


@dataclass(frozen=True)
class Source:
    """One local module as the session imported it."""

    origin: str  # the file it was read from (its __file__)
    source: bytes
    search: list[str] | None  # __path__ of a package, None for a module


class _Recorder(importlib.machinery.SourceFileLoader):
    """Loads a local module from disk and records the source it ran."""

    def __init__(self, fullname, path, search: list[str] | None, finder: LocalModules):
        super().__init__(fullname, path)
        self._search = search
        self._finder = finder

    def get_code(self, fullname):
        data = self.get_data(self.path)
        self._finder.loaded[fullname] = Source(self.path, data, self._search)
        return compile(data, self.path, "exec", dont_inherit=True)


class _FromSnapshot(importlib.abc.Loader):
    """Loads a local module from the source the session last imported."""

    def __init__(self, src: Source, finder: LocalModules):
        self._src = src
        self._finder = finder

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self._finder.loaded[module.__name__] = self._src
        exec(compile(self._src.source, self._src.origin, "exec", dont_inherit=True), module.__dict__)

    def get_source(self, fullname):  # tracebacks and inspect show the imported text
        return self._src.source.decode("utf-8", errors="replace")


class LocalModules(importlib.abc.MetaPathFinder):
    """A meta path finder, first on ``sys.meta_path`` in workers."""

    def __init__(self, baseline_path: list[str]):
        self._baseline = set(baseline_path)
        self._library = _dirs(p for p in baseline_path if p not in ("", "."))
        self.loaded: dict[str, Source] = {}  # what this worker imported
        self.session: dict[str, Source] = {}  # what the session had imported

    def add_library(self, paths: list[str]) -> None:
        """Entries put on the path before any cell ran (the session's package
        layer): what is installed there is a library, not the notebook's own."""
        self._baseline.update(paths)
        self._library += _dirs(p for p in paths if p not in ("", "."))

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def _is_local(self, origin: str) -> bool:
        """Under the working directory or a path the notebook added, and not in
        an installed library (a venv inside the notebook's folder is not local).
        A removed working directory holds no module (as for Python's own finders,
        it and the relative path entries are passed over)."""
        try:
            real = os.path.realpath(origin)
        except OSError:
            return False  # a relative origin, the working directory removed
        cwd = workdir.current()
        roots = _dirs([cwd] if cwd is not None else []) + _dirs(p for p in sys.path if p not in self._baseline)
        return any(real.startswith(r) for r in roots) and not any(real.startswith(r) for r in self._library)

    def find_spec(self, fullname, path=None, target=None):
        src = self.session.get(fullname)
        if src is not None and target is None:
            spec = importlib.util.spec_from_loader(
                fullname, _FromSnapshot(src, self), origin=src.origin, is_package=src.search is not None
            )
            if spec is not None:
                spec.has_location = True
                if src.search is not None:
                    spec.submodule_search_locations = list(src.search)
            return spec
        # a first import or a reload (target set): from disk, recorded if local
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if (
            spec is None
            or not isinstance(spec.loader, importlib.machinery.SourceFileLoader)
            or not spec.origin
            or not self._is_local(spec.origin)
        ):
            return spec
        search = list(spec.submodule_search_locations) if spec.submodule_search_locations else None
        spec.loader = _Recorder(fullname, spec.origin, search, self)
        return spec

    def snapshot(self) -> dict[str, Source]:
        """The local modules the session holds now: those still imported."""
        out = dict(self.session)
        out.update(self.loaded)
        return {n: s for n, s in out.items() if n in sys.modules}

    def adopt(self, session: dict[str, Source]) -> None:
        """Take the session's modules. A module this worker imported in another
        form (another worker reloaded it since) is forgotten, so the next import
        takes the session's."""
        for name, src in session.items():
            mine = self.loaded.get(name)
            if mine is not None and mine != src:
                self.loaded.pop(name, None)
                sys.modules.pop(name, None)
        self.session = dict(session)

    def unshadow(self, modules: list[str]) -> None:
        """Drop library modules a zygote imported that the session's own modules
        shadow (a ``utils.py`` beside the notebook beats an installed ``utils``;
        a removed working directory has none)."""
        cwd = workdir.current()
        for top in {m.split(".")[0] for m in modules}:
            mod = sys.modules.get(top)
            if mod is None or top in self.loaded:
                continue
            if (
                top in self.session
                or cwd is not None
                and (
                    os.path.isfile(os.path.join(cwd, top + ".py"))
                    or os.path.isfile(os.path.join(cwd, top, "__init__.py"))
                )
            ):
                for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                    del sys.modules[name]


def _dirs(paths) -> list[str]:
    """Directories as prefixes that match only files inside them; a relative
    one is left out while the working directory is removed (it names nothing)."""
    out = []
    for path in paths:
        try:
            out.append(os.path.realpath(path or ".").rstrip(os.sep) + os.sep)
        except OSError:
            pass
    return out
