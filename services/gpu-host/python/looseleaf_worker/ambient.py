"""Ambient session state: everything a later cell can observe that is not a
variable (DESIGN.md section 6). Saved as one pickled blob after every cell and
restored before the next, so a fresh worker continues like a pinned kernel.

Library state is captured only for libraries already imported, and restoring it
imports a library only when the saved state names it (importing torch or
matplotlib just to restore defaults would cost seconds and change nothing).
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import warnings
from typing import Any


class Baseline:
    """What the worker looked like before any cell ran (diffs are against it)."""

    def __init__(self):
        self.env = dict(os.environ)
        self.path = list(sys.path)
        self.filters = list(warnings.filters)
        self.np_print = None
        if "numpy" in sys.modules:
            self.np_print = sys.modules["numpy"].get_printoptions()


def _mpl_state() -> dict | None:
    mpl = sys.modules.get("matplotlib")
    if mpl is None:
        return None
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, opt in pc._registered_options.items():
            try:
                cur = pc._get_option(key, silent=True)
                if cur != opt.defval:
                    out[key] = cur
            except Exception:  # noqa: BLE001 - best effort per option
                pass
    return out


def capture(shell, base: Baseline) -> dict:
    """The ambient state as plain picklable values."""
    st: dict[str, Any] = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        st["numpy_rng"] = np.random.get_state()
        po = np.get_printoptions()
        if po != base.np_print:
            st["numpy_print"] = po
    torch = sys.modules.get("torch")
    if torch is not None:
        st["torch_rng"] = torch.get_rng_state().numpy().copy()
        try:
            if torch.cuda.is_initialized():
                st["torch_cuda_rng"] = [s.numpy().copy() for s in torch.cuda.get_rng_state_all()]
        except Exception:  # noqa: BLE001
            pass
    mpl = _mpl_state()
    if mpl is not None:
        st["rcparams"] = mpl
    pdo = _pandas_options()
    if pdo is not None:
        st["pandas"] = pdo
    st["cwd"] = os.getcwd()
    st["sys_path"] = list(sys.path)
    st["env_set"] = {k: v for k, v in os.environ.items() if base.env.get(k) != v}
    st["env_unset"] = [k for k in base.env if k not in os.environ]
    filters = []
    for f in warnings.filters:
        try:
            pickle.dumps(f)
            filters.append(f)
        except Exception:  # noqa: BLE001 - a filter on a notebook class: skip
            pass
    st["warnings"] = filters
    st["extensions"] = sorted(shell.extension_manager.loaded)
    st["config"] = {k: dict(v) for k, v in shell.config.items()
                    if k not in ("HistoryManager",) and isinstance(v, dict)}
    hm = shell.history_manager
    st["execution_count"] = shell.execution_count
    st["hist_parsed"] = list(hm.input_hist_parsed)
    st["hist_raw"] = list(hm.input_hist_raw)
    st["hist_i"] = (hm._i00, hm._i, hm._ii, hm._iii)
    return st


def dumps(shell, base: Baseline) -> bytes:
    return pickle.dumps(capture(shell, base), protocol=5)


def apply(shell, st: dict, base: Baseline) -> None:
    """Make this worker's ambient state equal ``st`` (best effort per item)."""
    random.setstate(st["random"])
    if "numpy_rng" in st or "numpy_print" in st:
        import numpy as np
        if "numpy_rng" in st:
            np.random.set_state(st["numpy_rng"])
        np.set_printoptions(**st.get("numpy_print") or base.np_print or {})
    if "torch_rng" in st:
        import torch
        torch.set_rng_state(torch.from_numpy(st["torch_rng"]))
        if "torch_cuda_rng" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.from_numpy(s) for s in st["torch_cuda_rng"]])
    if st.get("rcparams") is not None:
        import matplotlib as mpl
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k, v in st["rcparams"].items():
                try:
                    mpl.rcParams[k] = v
                except Exception:  # noqa: BLE001
                    pass
    if st.get("pandas"):
        import pandas as pd
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k, v in st["pandas"].items():
                try:
                    pd.set_option(k, v)
                except Exception:  # noqa: BLE001
                    pass
    try:
        os.chdir(st["cwd"])
    except OSError:
        pass  # the directory is gone; the cell will see where the host put it
    added = [p for p in st["sys_path"] if p not in sys.path]
    sys.path[:0] = added
    for k in st["env_unset"]:
        os.environ.pop(k, None)
    os.environ.update(st["env_set"])
    warnings.filters[:] = st["warnings"]
    warnings._filters_mutated()
    for ext in st["extensions"]:
        if ext not in shell.extension_manager.loaded:
            try:
                shell.extension_manager.load_extension(ext)
            except Exception:  # noqa: BLE001
                pass
    if st.get("config"):
        from traitlets.config import Config
        cfg = Config(st["config"])
        shell.config.merge(cfg)
        for c in list(shell.configurables):
            try:
                c.update_config(cfg)
            except Exception:  # noqa: BLE001
                pass
    shell.execution_count = st["execution_count"]
    hm = shell.history_manager
    hm.input_hist_parsed[:] = st["hist_parsed"]
    hm.input_hist_raw[:] = st["hist_raw"]
    hm._i00, hm._i, hm._ii, hm._iii = st["hist_i"]
    ns = shell.user_ns
    ns.update({"_i": hm._i, "_ii": hm._ii, "_iii": hm._iii})
    for n, src in enumerate(hm.input_hist_raw[1:], start=1):
        ns[f"_i{n}"] = src


def loads_apply(shell, blob, base: Baseline) -> None:
    apply(shell, pickle.loads(blob), base)
