import pickle
import re
import sys

from helpers import of_type, ok, result_text, stream_text


def test_rng_cwd_count_rcparams_continue_on_new_worker(host, zygote, tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    w1 = zygote.fork(cwd=str(tmp_path))
    ok(
        w1.run(
            "import numpy as np, random, os, sys, warnings\nimport matplotlib as mpl\nimport pandas as pd\n"
            f"np.random.seed(0); random.seed(5)\nos.chdir({str(sub)!r})\n"
            "mpl.rcParams['lines.linewidth'] = 7.5\npd.set_option('display.max_rows', 7)\n"
            "np.set_printoptions(precision=3)\nos.environ['LL_CELL_SET'] = '1'\n"
            "sys.path.append('/ll-added')\nwarnings.simplefilter('error', FutureWarning)"
        )
    )
    ok(w1.run("first = 'x'"))
    w1.save()
    # the pinned-kernel reference: the same worker keeps going
    ref = stream_text(ok(w1.run("print(np.random.rand(), random.random())")))

    w2 = zygote.fork(cwd=str(tmp_path))
    assert w2.restore(["np", "random", "os", "mpl", "pd", "sys", "warnings"])["ok"]
    r = ok(w2.run("print(np.random.rand(), random.random())"))
    assert stream_text(r) == ref
    assert r["finished"]["execution_count"] == 3
    r = ok(
        w2.run(
            "print(os.getcwd(), mpl.rcParams['lines.linewidth'], pd.get_option('display.max_rows'),"
            " np.get_printoptions()['precision'], os.environ.get('LL_CELL_SET'),"
            " '/ll-added' in sys.path, warnings.filters[0][0])"
        )
    )
    assert stream_text(r).split() == [str(sub), "7.5", "7", "3", "1", "True", "error"]
    # In history and _iN names came along
    assert result_text(w2.run("In[2], _i2")) == "(\"first = 'x'\", \"first = 'x'\")"


def test_library_state_is_applied_when_the_cell_imports_the_library(host, zygote):
    w1 = zygote.fork()
    ok(w1.run("import matplotlib as mpl\nmpl.rcParams['lines.linewidth'] = 4.5\nmpl.interactive(True)\nx = 1"))
    w1.save()
    w2 = zygote.fork()  # its zygote lacks matplotlib
    assert w2.restore(["x"])["ok"]
    r = ok(
        w2.run(
            "import sys\nprint('matplotlib' in sys.modules)\nimport matplotlib\n"
            "print(matplotlib.rcParams['lines.linewidth'], matplotlib.is_interactive())"
        )
    )
    # the restore left matplotlib out; the cell's import brought the session's rcParams
    assert stream_text(r).split() == ["False", "4.5", "True"]


def test_library_state_no_cell_imported_is_carried_into_the_next_save(host, zygote):
    w1 = zygote.fork()
    ok(w1.run("import matplotlib as mpl\nmpl.rcParams['lines.linewidth'] = 3.25\nx = 1"))
    w1.save()
    # a cell that never imports matplotlib, on a worker whose zygote lacks it, saves
    w2 = zygote.fork()
    assert w2.restore(["x"])["ok"]
    ok(w2.run("import sys\nassert 'matplotlib' not in sys.modules\ny = x + 1"))
    w2.save()
    w3 = zygote.fork()
    assert w3.restore(["y"])["ok"]
    r = ok(w3.run("import matplotlib\nprint(matplotlib.rcParams['lines.linewidth'], y)"))
    assert stream_text(r).split() == ["3.25", "2"]


def test_torch_rng_continuity(host, zygote):
    w1 = zygote.fork()
    ok(w1.run("import torch\ntorch.manual_seed(1)\n_ = torch.rand(2)"))
    w1.save()
    ref = stream_text(ok(w1.run("print(torch.rand(3).tolist())")))
    w2 = zygote.fork()
    assert w2.restore(["torch"])["ok"]
    assert stream_text(ok(w2.run("print(torch.rand(3).tolist())"))) == ref


def test_underscore_names_are_variables(host, zygote):
    w1 = zygote.fork()
    ok(w1.run("40 + 2"))
    delta = w1.save()["ready"]["delta"]
    assert "_" in delta["variables"] and "_1" in delta["variables"]
    assert not any(n.startswith("_i") or n in ("In", "Out") for n in delta["variables"])
    w2 = zygote.fork()
    assert w2.restore(["_", "_1"])["ok"]
    assert result_text(w2.run("_1 + 1")) == "43"
    assert result_text(w2.run("__")) == "42"  # the displayhook rotated the restored _


def test_slot_env_from_restore_is_not_ambient_state(host, zygote):
    # a worker prepared without a GPU slot gets its devices with the restore at Run
    w1 = zygote.fork()
    assert w1.restore([], env={"CUDA_VISIBLE_DEVICES": "3"})["ok"]
    r = ok(w1.run("import os\nprint(os.environ['CUDA_VISIBLE_DEVICES'])\nos.environ['LL_CELL_SET'] = 'yes'"))
    assert stream_text(r).strip() == "3"
    w1.save()
    # the next worker keeps what the cell set, not the slot of the last worker
    w2 = zygote.fork()
    assert w2.restore(["os"])["ok"]
    r = ok(w2.run("print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), os.environ.get('LL_CELL_SET'))"))
    devices, cell_set = stream_text(r).split()
    assert (devices != "'3'", cell_set) == (True, "yes")


def test_the_import_hook_calls_back_with_the_module_asked_for_only(tmp_path):
    # one zipimporter loads every module of its archive: the hook must not take
    # ll_beta, imported while ll_alpha loads, for ll_alpha
    import sys
    import zipfile

    from looseleaf_worker import ambient

    archive = tmp_path / "mods.zip"
    with zipfile.ZipFile(archive, "w") as f:
        f.writestr("ll_alpha.py", "import ll_beta\nVALUE = 'alpha'\n")
        f.writestr("ll_beta.py", "VALUE = 'beta'\n")
    sys.path.insert(0, str(archive))
    seen = []
    try:
        ambient.when_imported("ll_alpha", lambda m: seen.append(m.VALUE), {"saved": 1})
        assert ambient._on_import().unapplied() == {"saved": 1}  # carried until imported
        import ll_alpha

        assert seen == ["alpha"]
        assert ambient._on_import().unapplied() == {}
        assert "exec_module" not in vars(ll_alpha.__loader__), "the shared loader is itself again"
    finally:
        sys.path.remove(str(archive))
        for name in ("ll_alpha", "ll_beta"):
            sys.modules.pop(name, None)
        sys.meta_path.remove(ambient._on_import())


def test_the_input_history_is_saved_once_each_and_restored_whole(host, zygote):
    # every save carries the session's whole input history: one copy of each
    # input, not raw, parsed and linecache copies of it
    w1 = zygote.fork()
    big = "x = '" + "a" * 50_000 + "'"
    ok(w1.run(big))
    ok(w1.run("%time y = 1"))
    ok(w1.run("def boom():\n    raise ValueError('from the third cell')"))
    w1.save()
    assert 50_000 < host.ambient["len"] < 75_000, host.ambient["len"]
    parsed = result_text(w1.run("_ih[2]"))
    assert "run_line_magic" in parsed, parsed

    w2 = zygote.fork()
    assert w2.restore(["boom"])["ok"]
    assert result_text(w2.run("_ih[2]")) == parsed  # the parsed input, where it differs
    raw = "get_ipython().history_manager.input_hist_raw"
    assert result_text(w2.run(f"In[1] == {big!r}, {raw}[2], _i2")) == "(True, '%time y = 1', '%time y = 1')"
    tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(of_type(w2.run("boom()"), "error")[0]["traceback"]))
    assert "raise ValueError('from the third cell')" in tb, tb


def test_logging_decimal_numpy_torch_builtins_and_process_settings_carry_over(host, zygote, tmp_path):
    # set in one cell, relied on in later ones: a fresh worker must not silently
    # drop log lines or compute with another precision
    log_file = tmp_path / "cells.log"
    w1 = zygote.fork(cwd=str(tmp_path))
    setup = (
        "import logging, decimal, sys, numpy as np, torch\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s|%(name)s|%(message)s')\n"
        "log = logging.getLogger('probe')\n"
        f"log.addHandler(logging.FileHandler({str(log_file)!r}, mode='w'))\n"
        "log.handlers[-1].setFormatter(logging.Formatter('{levelname}:{message}', style='{'))\n"
        "logging.getLogger('quiet.lib').setLevel(logging.ERROR)\n"
        "log.info('first')\n"
        "decimal.getcontext().prec = 5\n"
        "np.seterr(all='raise')\n"
        "sys.setrecursionlimit(4321)\n"
        "torch.set_default_dtype(torch.float64)\n"
        "torch.set_grad_enabled(False)\n"
        "torch.set_printoptions(precision=2)\n"
        "import builtins, os, socket\n"
        "builtins.twice = lambda v: v * 2\n"
        "sys.argv = ['nb', '--flag']\n"
        "os.umask(0o027)\n"
        "socket.setdefaulttimeout(7.5)"
    )
    ok(w1.run(setup))
    w1.save()

    w2 = zygote.fork(cwd=str(tmp_path))
    assert w2.restore(["logging", "decimal", "sys", "np", "torch", "log"])["ok"]
    r = ok(w2.run("log.info('second')\nlogging.getLogger('quiet.lib').warning('dropped')\nlogging.info('root')"))
    assert stream_text(r, "stderr") == "INFO|probe|second\nINFO|root|root\n"
    # the file handler reopened for appending: what the first cell wrote is kept
    assert log_file.read_text() == "INFO:first\nINFO:second\n"
    code = (
        "print(decimal.Decimal(1) / decimal.Decimal(7), sys.getrecursionlimit())\n"
        "try:\n    np.array([1.0]) / 0\nexcept FloatingPointError:\n    print('raised')\n"
        "print(torch.zeros(1).dtype, torch.is_grad_enabled(), torch.tensor([1.23456]))"
    )
    code += "\nimport os, socket\nprint(twice(4), sys.argv, oct(os.umask(0o027)), socket.getdefaulttimeout())"
    assert stream_text(ok(w2.run(code))).splitlines() == [
        "0.14286 4321",
        "raised",
        "torch.float64 False tensor([1.23])",
        "8 ['nb', '--flag'] 0o27 7.5",
    ]
    # a worker that applies its own state again adds no second handler
    w2.save()
    w3 = zygote.fork(cwd=str(tmp_path))
    assert w3.restore(["log", "logging"])["ok"]
    r = ok(w3.run("log.info('third')\nprint(len(logging.root.handlers), len(log.handlers))"))
    assert (stream_text(r, "stderr"), stream_text(r)) == ("INFO|probe|third\n", "1 1\n")


def test_attributes_a_cell_set_on_library_modules_and_classes_carry_over(host, zygote, tmp_path):
    # a module is saved as its import: what a cell set on it, on a class of it or
    # on the session's own module must be set again in a fresh worker
    (tmp_path / "helper.py").write_text("VALUE = 1\ndef get():\n    return VALUE\n")
    w1 = zygote.fork(cwd=str(tmp_path))
    setup = (
        "import math, sklearn, torch, helper\nimport pandas as pd\nfrom pandas import Series\n"
        "math.golden = (1 + 5 ** 0.5) / 2\n"
        "pd.DataFrame.total = lambda self: int(self.to_numpy().sum())\n"
        "Series.twice = lambda self: self * 2\n"
        "torch.backends.cudnn.benchmark = True\n"
        "helper.VALUE = 42\n"
        "sklearn.set_config(assume_finite=True)\n"
        "torch.manual_seed(3)"
    )
    ok(w1.run(setup))
    w1.save()
    later = "import torch\nprint(round(torch.rand(1).item(), 6), torch.backends.cudnn.benchmark)"
    pinned = stream_text(ok(w1.run(later)))

    w2 = zygote.fork(cwd=str(tmp_path))
    assert w2.restore(["math", "pd", "sklearn", "helper", "Series"])["ok"]
    assert stream_text(ok(w2.run(later))) == pinned
    assert pinned.split()[1] == "True"
    code = (
        "print(round(math.golden, 3), pd.DataFrame({'a': [1, 2]}).total(), Series([1]).twice().tolist(),"
        " helper.get(), sklearn.get_config()['assume_finite'])"
    )
    assert stream_text(ok(w2.run(code))) == "1.618 3 [2] 42 True\n"


def test_two_kinds_of_state_of_one_library_both_apply_at_its_import(tmp_path, monkeypatch):
    # a library's RNG and an attribute a cell set on it wait for one import
    from looseleaf_worker.ambient import _on_import, when_imported

    (tmp_path / "lib_not_yet.py").write_text("SEEN = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the hook goes with the test
    monkeypatch.delitem(sys.modules, "lib_not_yet", raising=False)
    when_imported("lib_not_yet", lambda m: m.SEEN.append("rng"), {"rng": 1})
    when_imported("lib_not_yet", lambda m: m.SEEN.append("attribute"), {"attr": 2})
    assert _on_import().unapplied() == {"rng": 1, "attr": 2}  # carried until then
    import lib_not_yet

    assert lib_not_yet.SEEN == ["rng", "attribute"]
    assert "lib_not_yet" not in _on_import().pending


def test_warning_filters_on_a_library_s_categories_wait_for_its_import(host, zygote):
    # loading the ambient state must not import torch (a second or more) for a
    # cell that never uses it; the session's filters on torch's categories are
    # set once a cell imports it, and carried by workers that never do
    w1 = zygote.fork()
    ok(w1.run("import torch, warnings\nwarnings.filterwarnings('error', category=torch.jit.TracerWarning)\nx = 1"))
    w1.save()
    filters = "import warnings\n[(a, c.__name__, str(m)) for a, m, c, *_ in warnings.filters]"
    pinned = result_text(ok(w1.run(filters)))
    assert "('error', 'TracerWarning', 'None')" in pinned

    w2 = zygote.fork()
    assert w2.restore(["x"])["ok"]
    assert result_text(ok(w2.run("import sys\n'torch' in sys.modules"))) == "False"
    w2.save()  # a save by a worker that never imported torch

    w3 = zygote.fork()
    assert w3.restore(["x"])["ok"]
    assert result_text(ok(w3.run("import torch\n" + filters))) == pinned


def test_the_last_error_is_there_for_tb_in_a_later_worker(host, zygote):
    w1 = zygote.fork()
    assert w1.run("undefined_here")["finished"]["status"] == "error"
    ok(w1.run("x = 1"))
    w1.save()
    w2 = zygote.fork()
    assert w2.restore(["x"])["ok"]
    assert result_text(ok(w2.run("import sys\ntype(sys.last_value).__name__, str(sys.last_value)"))) == (
        "('NameError', \"name 'undefined_here' is not defined\")"
    )
    errors = of_type(w2.run("%tb"), "error")
    assert [(e["ename"], e["evalue"]) for e in errors] == [("NameError", "name 'undefined_here' is not defined")]


def test_a_plain_cell_s_save_holds_only_what_a_cell_changed(host, zygote):
    # the worker's own changes to the process (its eval and exec in builtins, its
    # loggers) are not the session's state: captured, they would be pickled (and
    # fail) after every cell
    logged = len(zygote.log_text())
    w = zygote.fork()
    ok(w.run("x = 1"))
    w.save()
    st = pickle.loads(host.blob(host.ambient))
    extra = {"builtins", "process", "last_error", "module_patches", "decimal", "recursion_limit", "numpy_err"}
    assert extra.isdisjoint(st), sorted(extra.intersection(st))
    assert st.get("logging") is None or set(st["logging"]["loggers"]) <= {"Comm"}, st.get("logging")
    assert "cannot keep" not in zygote.log_text()[logged:]  # nothing was even tried
