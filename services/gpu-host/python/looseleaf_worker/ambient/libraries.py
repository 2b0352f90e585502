"""Libraries' own state: matplotlib's rcParams, pandas' options and sympy's
printing setup read from the libraries a worker imported, and these, numpy's RNG
and print options and torch's RNGs applied to them (``state.capture`` reads the
RNGs itself)."""

from __future__ import annotations

import pickle
import sys
from typing import TYPE_CHECKING

import cloudpickle

from .. import quiet

if TYPE_CHECKING:
    from .baseline import Baseline


def _mpl_state() -> dict | None:
    mpl = sys.modules.get("matplotlib")
    if mpl is None:
        return None
    out = {}
    with quiet.own_warnings(show=False):
        for k, v in mpl.rcParams.items():
            if k in ("backend", "backend_fallback"):
                continue
            if mpl.rcParamsDefault.get(k) != v:
                out[k] = v
    return out


def _pandas_options() -> dict | None:
    pd = sys.modules.get("pandas")
    if pd is None:
        return None
    try:
        from pandas._config import config as pc
    except ImportError:
        return None
    out = {}
    root = getattr(pc, "_global_config", {})
    with quiet.own_warnings(show=False):
        for key, opt in pc._registered_options.items():
            try:
                # read where pandas keeps it: _get_option's key checks made this
                # a quarter of every cell's ambient capture
                *path, last = key.split(".")
                node = root
                for part in path:
                    node = node[part]
                cur = node[last]
            except (KeyError, TypeError):
                try:
                    cur = pc._get_option(key, silent=True)
                except Exception:  # noqa: BLE001 - best effort per option
                    continue
            try:
                if cur != opt.defval:
                    out[key] = cur
            except Exception:  # noqa: BLE001 - best effort per option
                pass
    return out


def _sympy_printing() -> dict | None:
    """What sympy's init_printing sets besides formatter printers: the printers'
    global settings (unicode, order) and Printable's ``_repr_*_`` methods."""
    if "sympy" not in sys.modules:
        return None
    try:
        from sympy.core._print_helpers import Printable
        from sympy.printing.printer import Printer
    except ImportError:
        return None
    reprs = {}
    for attr in ("_repr_latex_", "_repr_png_", "_repr_svg_"):
        fn = Printable.__dict__.get(attr)
        if fn is not None and getattr(fn, "__qualname__", "") != f"Printable.{attr}":
            reprs[attr] = fn
    if not reprs and not Printer._global_settings:
        return None
    try:
        return {"settings": dict(Printer._global_settings), "reprs": cloudpickle.dumps(reprs)}
    except Exception as e:  # noqa: BLE001
        quiet.log(f"looseleaf worker: cannot keep sympy's printing setup: {type(e).__name__}: {e}")
        return None


def _apply_sympy(st: dict) -> None:
    from sympy.core._print_helpers import Printable
    from sympy.printing.printer import Printer

    Printer.set_global_settings(**st["settings"])
    for attr, fn in pickle.loads(st["reprs"]).items():
        setattr(Printable, attr, fn)


def _apply_numpy(np, st: dict, base: Baseline) -> None:
    if "numpy_rng" in st:
        np.random.set_state(st["numpy_rng"])
    # setting costs ~0.4 ms of every start; a fresh worker already has the baseline
    want = st.get("numpy_print") or base.np_print
    if want and np.get_printoptions() != want:
        np.set_printoptions(**want)


def _apply_torch(torch, st: dict) -> None:
    torch.set_rng_state(torch.from_numpy(st["torch_rng"]))
    if "torch_cuda_rng" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(s) for s in st["torch_cuda_rng"]])


def _set_options(set_one, options: dict) -> None:
    with quiet.own_warnings(show=False):
        for k, v in options.items():
            try:
                set_one(k, v)
            except Exception:  # noqa: BLE001 - an option this version lacks
                pass
