"""Libraries' own state: matplotlib's rcParams, pandas' options, sympy's printing
setup and torch's settings read from the libraries a worker imported, and these,
numpy's RNG, print options and error handling and torch's RNGs applied to them
(``state.capture`` reads the RNGs and numpy's options itself)."""

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


# numpy's floating-point error handling as a fresh process has it (np.seterr)
NUMPY_ERR = {"divide": "warn", "over": "warn", "under": "ignore", "invalid": "warn"}


def _apply_numpy(np, st: dict, base: Baseline) -> None:
    if "numpy_rng" in st:
        np.random.set_state(st["numpy_rng"])
    # setting costs ~0.4 ms of every start; a fresh worker already has the baseline
    want = st.get("numpy_print") or base.np_print
    if want and np.get_printoptions() != want:
        np.set_printoptions(**want)
    err = st.get("numpy_err") or base.np_err or NUMPY_ERR
    if np.geterr() != err:
        np.seterr(**err)


# torch's process-wide settings as a fresh process has them: what a cell changes
# with set_default_dtype, set_grad_enabled, use_deterministic_algorithms and
# set_printoptions
TORCH_DEFAULTS = {
    "default_dtype": "float32",
    "grad_enabled": True,
    "deterministic": False,
    "print": {"precision": 4, "threshold": 1000, "edgeitems": 3, "linewidth": 80, "sci_mode": None},
}


def _torch_settings(torch) -> dict:
    """Those of torch's settings that differ from a fresh process's."""
    now = {}
    try:
        now["default_dtype"] = str(torch.get_default_dtype()).removeprefix("torch.")
        now["grad_enabled"] = torch.is_grad_enabled()
        now["deterministic"] = torch.are_deterministic_algorithms_enabled()
        opts = torch._tensor_str.PRINT_OPTS
        now["print"] = {k: getattr(opts, k) for k in TORCH_DEFAULTS["print"]}
    except Exception:  # noqa: BLE001 - a torch without one of them: keep the rest
        pass
    return {k: v for k, v in now.items() if v != TORCH_DEFAULTS[k]}


def _apply_torch(torch, st: dict) -> None:
    torch.set_rng_state(torch.from_numpy(st["torch_rng"]))
    if "torch_cuda_rng" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(s) for s in st["torch_cuda_rng"]])
    want = {**TORCH_DEFAULTS, **st.get("torch_settings", {})}
    if _torch_settings(torch) == st.get("torch_settings", {}):
        return  # as it is already (a fresh worker, or one applying its own state)
    with quiet.own_warnings(show=False):
        for apply in (
            lambda: torch.set_default_dtype(getattr(torch, want["default_dtype"])),
            lambda: torch.set_grad_enabled(want["grad_enabled"]),
            lambda: torch.use_deterministic_algorithms(want["deterministic"]),
            lambda: torch.set_printoptions(**want["print"]),
        ):
            try:
                apply()
            except Exception:  # noqa: BLE001 - best effort per setting
                pass


def _set_options(set_one, options: dict) -> None:
    with quiet.own_warnings(show=False):
        for k, v in options.items():
            try:
                set_one(k, v)
            except Exception:  # noqa: BLE001 - an option this version lacks
                pass


def _sklearn_config() -> dict | None:
    """What ``sklearn.set_config`` changed (the thread's configuration against
    the process-wide defaults it starts from)."""
    if "sklearn" not in sys.modules:
        return None
    try:
        from sklearn import _config

        now, defaults = _config.get_config(), _config._global_config
    except Exception:  # noqa: BLE001 - a scikit-learn without them
        return None
    return {k: v for k, v in now.items() if defaults.get(k) != v} or None


def _apply_sklearn(sklearn, changed: dict) -> None:
    for k, v in changed.items():
        try:
            sklearn.set_config(**{k: v})
        except Exception:  # noqa: BLE001 - a setting this version lacks
            pass
