"""Ambient session state: everything a later cell can observe that is not a
variable (DESIGN.md section 6). Saved as one pickled blob after every cell and
restored before the next, so a fresh worker continues like a pinned kernel.

Library state is captured only for libraries already imported, and restored
only into a worker that has the library: at once if its zygote imported it, else
when a cell first imports it (``when_imported``; importing torch or matplotlib
at restore would cost up to seconds for cells that never touch them).

Map (one concern per module):
  baseline   the worker before any cell ran (Baseline)
  state      the whole state: capture/dumps after a cell, loads/apply_paths/apply
  filters    warning filters, loaded without importing their libraries
  libraries  RNGs, matplotlib/pandas options, numpy print and error options,
             sympy printing, torch's settings, scikit-learn's set_config
  stdlib     logging's configuration, decimal's context, the recursion limit,
             builtins a cell added, sys.argv, the umask, socket's timeout
  patches    attributes a cell set on a library's module or class
  onimport   library state applied when a cell first imports the library
  settings   shell settings a cell changed
  magics     magics the notebook registered
  hooks      finders, path hooks, transformers, event callbacks, display printers
  byvalue    notebook objects pickled by value with the live namespace
  inline     figures of a session that drew inline
"""

from .baseline import Baseline
from .hooks import _LazyPrinter
from .onimport import _on_import, _OnImport, when_imported
from .state import apply, apply_paths, capture, dumps, loads

__all__ = [
    "Baseline",
    "apply",
    "apply_paths",
    "capture",
    "dumps",
    "loads",
    "when_imported",
    # see test_ambient
    "_on_import",
    # instances sit where a variable may hold one (the display formatters,
    # sys.meta_path): saved records name these classes looseleaf_worker.ambient.X
    "_LazyPrinter",
    "_OnImport",
]
