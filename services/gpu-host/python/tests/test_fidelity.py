"""Notebook semantics a session keeps across workers as one kernel keeps them:
modules beside the notebook, registered magics, display messages, output order,
earlier cells' source in tracebacks, and the platform's own warnings kept out of
cells' outputs. Each test fails on a worker that lacks the behaviour."""

import re
import textwrap
from pathlib import Path

from helpers import of_kind, of_type, ok, result_text, stream_text
from hostsim import INTERRUPT


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


# ------------------------------------------------------------ local modules


def test_modules_beside_the_notebook_import_and_keep_their_imported_source(zygote, tmp_path):
    _write(tmp_path / "helpers" / "__init__.py", "from .maths import double\n")
    _write(tmp_path / "helpers" / "maths.py", "def double(x):\n    return 2 * x\n")
    w1 = zygote.fork(cwd=str(tmp_path))
    assert result_text(ok(w1.run("from helpers.maths import double\nimport helpers\ndouble(21)"))) == "42"
    w1.save()

    # the file changes on disk; the session keeps what it imported, as a kernel does
    _write(tmp_path / "helpers" / "maths.py", "def double(x):\n    return 3 * x\n")
    w2 = zygote.fork(cwd=str(tmp_path))
    assert w2.restore(["double", "helpers"], imports=["helpers", "helpers.maths"])["ok"]
    assert result_text(ok(w2.run("double(21), helpers.double(1)"))) == "(42, 2)"
    # and a module of the session a cell imports again comes from the same source
    assert result_text(ok(w2.run("import helpers.maths as m\nm.double(5)"))) == "10"

    # until the notebook reloads it: then every later worker has the new one
    assert result_text(ok(w2.run("import importlib\nimportlib.reload(m)\nm.double(5)"))) == "15"
    w2.save()
    w3 = zygote.fork(cwd=str(tmp_path))
    assert w3.restore(["m"], imports=["helpers.maths"])["ok"]
    assert result_text(ok(w3.run("m.double(5)"))) == "15"


def test_a_zygote_never_imports_from_the_directory_it_started_in(host, tmp_path):
    # hostsim starts zygotes in the runtime's folder: a module there is not a library
    z = host.zygote(["numpy"])
    w = z.fork(cwd=str(tmp_path))
    r = ok(w.run("import sys, os\nos.getcwd() == sys.path[0] or sys.path[0] == ''"))
    assert of_type(r, "execute_result")[0]["data"]["text/plain"] == "True"
    # `python -m` put the zygote's start folder first on its path: it is gone (the
    # folder stays on the path once, through PYTHONPATH, as the host sets it)
    start = str(Path(__file__).resolve().parent.parent)
    assert result_text(ok(w.run(f"sys.path.count({start!r})"))) == "1"


def test_a_local_module_shadows_a_library_the_zygote_imported(host, tmp_path):
    z = host.zygote(["ll_probe"])  # tests/fakepkgs/ll_probe.py
    _write(tmp_path / "ll_probe.py", "WHO = 'the notebook folder'\n")
    w0 = z.fork(cwd=str(tmp_path))
    ok(w0.run("shadow_test = 1"))
    w0.save()
    w = z.fork(cwd=str(tmp_path))
    assert w.restore(["shadow_test"], imports=["ll_probe"], ambient=False)["ok"]
    assert result_text(ok(w.run("import ll_probe\nll_probe.WHO"))) == "'the notebook folder'"


# ------------------------------------------------------------------- magics

MAGICS = """
from IPython.core.magic import register_cell_magic, register_line_magic

@register_line_magic
def shout(line):
    print(line.upper())

@register_cell_magic
def settings(line, cell):
    get_ipython().user_ns[line.strip()] = dict(l.split('=') for l in cell.split())

get_ipython().register_magic_function(lambda line: print('renamed', line), 'line', 'other')
%alias say echo said %s
"""


def test_registered_magics_aliases_and_extensions_work_in_later_workers(zygote, tmp_path):
    _write(
        tmp_path / "myext.py",
        """
        from IPython.core.magic import Magics, line_magic, magics_class

        @magics_class
        class M(Magics):
            @line_magic
            def mean(self, line):
                print(line, sum(self.shell.user_ns[line]) / len(self.shell.user_ns[line]))

        def load_ipython_extension(ip):
            ip.register_magics(M)
            print("myext loaded")
    """,
    )
    w1 = zygote.fork(cwd=str(tmp_path))
    ok(w1.run(MAGICS))
    r = ok(w1.run("%load_ext myext"))
    assert stream_text(r) == "myext loaded\n"
    ok(w1.run("xs = [1, 2, 3]"))
    w1.save()

    # a worker whose cell needs none of them keeps them for the session
    w1b = zygote.fork(cwd=str(tmp_path))
    assert w1b.restore(["xs"])["ok"]
    ok(w1b.run("ys = xs"))
    w1b.save()

    w2 = zygote.fork(cwd=str(tmp_path))
    # the planner's closure of `%shout hi` brings `shout` (the magic's name), of
    # `%mean xs` the variable it names
    restored = w2.restore(["shout", "settings", "xs"])
    assert restored["ok"], restored
    assert stream_text(ok(w2.run("%shout hi"))) == "HI\n"
    ok(w2.run("%%settings cfg\na=1 b=2"))
    assert result_text(ok(w2.run("cfg"))) == "{'a': '1', 'b': '2'}"
    assert stream_text(ok(w2.run("%other x"))) == "renamed x\n"
    assert stream_text(ok(w2.run("%say hello"))).replace("\r", "") == "said hello\n"
    # the extension came back without printing into a cell
    assert stream_text(ok(w2.run("%mean xs"))) == "xs 2.0\n"


# ----------------------------------------------------------------- displays


def test_display_messages_go_out_as_jupyter_messages(zygote):
    w = zygote.fork()
    r = ok(
        w.run(
            "from IPython.display import display, clear_output, update_display\n"
            "h = display('first', display_id=True)\n"
            "print('a')\nclear_output(wait=True)\nprint('b')\n"
            "h.update('second')\nupdate_display('third', display_id=h.display_id)"
        )
    )
    kinds = [o["output_type"] for o in r["outputs"]]
    assert kinds == [
        "display_data",
        "stream",
        "clear_output",
        "stream",
        "update_display_data",
        "update_display_data",
    ], kinds
    shown, clear = r["outputs"][0], r["outputs"][2]
    assert shown["transient"]["display_id"] == r["outputs"][4]["transient"]["display_id"]
    assert clear["wait"] is True
    assert r["outputs"][5]["data"]["text/plain"] == "'third'"


def test_help_goes_to_the_pager_not_the_notebook(zygote):
    w = zygote.fork()
    r = ok(w.run("x = 1\nx?"))
    assert [list(m) for m in r["messages"]] == [["pager"]], r["messages"]
    assert "int" in r["messages"][0]["pager"]["data"]["text/plain"]
    assert r["messages"][0]["pager"]["start"] == 0


def test_capture_keeps_a_cell_silent_and_shows_later(zygote):
    w = zygote.fork()
    r = ok(w.run("%%capture cap\nprint('hidden')\nfrom IPython.display import display\ndisplay('rich')"))
    assert r["messages"] == []
    w.save()
    w2 = zygote.fork()
    assert w2.restore(["cap"])["ok"]
    r = ok(w2.run("cap.show()"))
    assert stream_text(r) == "hidden\n" and len(of_type(r, "display_data")) == 1


def test_stdout_and_stderr_arrive_as_from_ipykernel(zygote):
    w = zygote.fork()
    # a quick cell: all of stdout, then stderr (ipykernel flushes stdout first)
    r = ok(w.run("import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')"))
    assert [(o["name"], o["text"]) for o in r["outputs"]] == [("stdout", "a\nc\n"), ("stderr", "b\n")]
    # text older than the flush interval goes before what comes later
    r = ok(w.run("import time\nprint('a')\ntime.sleep(0.3)\nprint('b', file=sys.stderr)\ntime.sleep(0.3)\nprint('c')"))
    assert [o["name"] for o in r["outputs"]] == ["stdout", "stderr", "stdout"]


def test_a_figure_from_an_earlier_cell_renders_as_png_in_a_fresh_worker(zygote):
    w1 = zygote.fork()
    r = ok(w1.run("import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2]);"))
    assert of_type(r, "display_data")
    w1.save()
    ref = of_type(ok(w1.run("fig")), "execute_result")[0]["data"]
    w2 = zygote.fork()
    assert w2.restore(["fig"])["ok"]
    data = of_type(ok(w2.run("fig")), "execute_result")[0]["data"]
    assert sorted(data) == sorted(ref) == ["image/png", "text/plain"]


# ---------------------------------------------- earlier cells' source lines


def test_tracebacks_and_warnings_show_source_lines_of_earlier_cells(zygote):
    w1 = zygote.fork()
    ok(
        w1.run(
            "import warnings\ndef check(v):\n    if v > 1:\n        warnings.warn('too big')\n    return 1 / (v - v)"
        )
    )
    w1.save()
    w2 = zygote.fork()
    assert w2.restore(["check", "warnings"])["ok"]
    r = w2.run("check(2)")
    assert "warnings.warn('too big')" in stream_text(r, "stderr")
    tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(of_type(r, "error")[0]["traceback"]))
    assert "return 1 / (v - v)" in tb and "Cell In[1]" in tb


# ------------------------------------------------ the platform's own output


def test_the_platforms_warnings_never_reach_a_cell_and_user_filters_hold(zygote):
    w = zygote.fork()
    ok(
        w.run(
            "import warnings\nclass Noisy:\n"
            "    def __reduce__(self):\n"
            "        warnings.warn('from the save', FutureWarning)\n"
            "        print('printed by the save')\n"
            "        return (Noisy, ())\n"
            "n = Noisy()\nwarnings.simplefilter('error', FutureWarning)"
        )
    )
    saved = w.save()
    assert saved["committed"]["ok"]
    r = ok(w.run("print('next cell')"))
    assert r["messages"] == [{"output": {"output_type": "stream", "name": "stdout", "text": "next cell\n"}}]
    # the user's filter is still in force for the user's own code
    r = w.run("warnings.warn('mine', FutureWarning)")
    assert of_type(r, "error")[0]["ename"] == "FutureWarning"


def test_a_worker_that_restores_again_keeps_drawing(zygote):
    # the session's CPU worker restores before each cell: the inline set-up must
    # not stack up (it once recursed into itself on every later figure)
    w = zygote.fork()
    ok(w.run("import matplotlib.pyplot as plt\nplt.plot([1, 2]);"))
    w.save()
    for _ in range(3):
        assert w.restore(["plt"])["ok"]
        r = ok(w.run("fig, ax = plt.subplots()\nax.plot([2, 1]);"))
        assert [o["output_type"] for o in r["outputs"]] == ["display_data"]
        w.save()


# ------------------------------------------------------- names reached by eval

DISPLAY = """
class show:
    def __init__(self, *names):
        self.names = names
    def _repr_html_(self):
        return " | ".join(f"{n}={eval(n)!r}" for n in self.names)
"""


def test_names_reached_by_eval_are_brought_in_from_the_committed_state(zygote):
    w1 = zygote.fork()
    ok(w1.run(DISPLAY))
    ok(w1.run("a = [1, 2]\nb = a\nc = {'k': 3}"))
    w1.save()

    # the closure had only `show`: `a` and `b` come in when eval reaches them,
    # sharing objects as if restored up front, and the run says so
    w2 = zygote.fork()
    assert w2.restore(["show"])["ok"]
    r = ok(w2.run("show('a', 'b', 'a is b')"))
    assert of_type(r, "execute_result")[0]["data"]["text/html"] == "a=[1, 2] | b=[1, 2] | a is b=True"
    assert sorted(r["finished"]["faulted"]) == ["a", "b"]
    assert [n for names in r["faults"] for n in names] == ["a", "b"]
    # exec at top level binds in the namespace; a name the session never had is a
    # NameError, asked for once
    r = w2.run("exec('d = c[\"k\"] + 1')\nprint(d)\neval('nowhere')")
    assert stream_text(r) == "4\n" and of_type(r, "error")[0]["ename"] == "NameError"
    assert r["finished"]["faulted"] == ["c"] and r["faults"] == [["c"], ["nowhere"]]
    # library code's eval is untouched, and an error inside eval shows no frame of ours
    r = w2.run("import collections\nP = collections.namedtuple('P', 'x y')\nP(1, 2)")
    assert result_text(r) == "P(x=1, y=2)" and "faulted" not in r["finished"]
    tb = "\n".join(of_type(w2.run("eval('1/0')"), "error")[0]["traceback"])
    assert "faults.py" not in tb


# ------------------------------------------------------ a new kernel's defaults


def test_each_worker_starts_with_fresh_entropy(zygote):
    # forks of one zygote would share numpy's and torch's generator states: two
    # sessions' first unseeded draws must differ, as two kernels' do
    code = "import numpy as np, torch, random\nprint(np.random.rand(), torch.rand(1).item(), random.random())"
    a, b = (stream_text(ok(zygote.fork().run(code))).split() for _ in range(2))
    assert all(x != y for x, y in zip(a, b, strict=True)), (a, b)


def test_a_worker_handed_out_by_a_spare_looks_like_a_new_kernel(zygote):
    # a spare sets itself up and rehearses a restore before it is handed out:
    # none of that may show in the session
    w = zygote.fork()
    r = ok(
        w.run(
            "import sys, warnings\nip = get_ipython()\n"
            "print(ip.execution_count, repr(_i), len(In), len(Out), ip.history_manager.input_hist_raw[:1])\n"
            "print(sorted(n for n in globals() if not n.startswith('_') and n not in ('In', 'Out', 'exit', 'quit',"
            " 'get_ipython', 'open', 'sys', 'warnings', 'ip')))\n"
            "print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))"
        )
    )
    count, i_prev, n_in, n_out, hist = stream_text(r).splitlines()[0].split(" ", 4)
    assert (count, i_prev, n_in, n_out, hist) == ("1", "''", "2", "0", "['']")
    assert stream_text(r).splitlines()[1:] == ["[]", "[]"]


def test_input_and_getpass_ask_the_client_for_a_line(zygote):
    w = zygote.fork()
    code = "print('before')\nname = input('name? ')\nimport getpass\npw = getpass.getpass()"
    r = ok(w.run(code, answers=["Ada", "s3"]))
    assert [(i["prompt"], i["password"]) for i in r["inputs"]] == [("name? ", False), ("Password: ", True)]
    # what the cell printed before it asked reaches the client first
    assert stream_text(r) == "before\n"
    assert stream_text(ok(w.run("print(name, pw)"))) == "Ada s3\n"


def test_input_without_a_stdin_channel_fails_as_in_ipykernel(zygote):
    # the frontend refuses for a client without a stdin channel (nbclient)
    w = zygote.fork()
    err = of_type(w.run("name = input('name? ')"), "error")[0]
    assert err["ename"] == "StdinNotImplementedError"
    assert err["evalue"] == "raw_input was called, but this frontend does not support input requests."
    err = of_type(w.run("import getpass\ngetpass.getpass()"), "error")[0]
    assert err["ename"] == "StdinNotImplementedError" and err["evalue"].startswith("getpass was called")


def test_an_interrupt_while_input_waits_is_a_keyboard_interrupt_in_the_cell(zygote):
    w = zygote.fork()
    r = w.run("x = 1\nname = input('name? ')\nx = 2", answers=[INTERRUPT])
    assert r["finished"]["error"]["ename"] == "KeyboardInterrupt"
    # the worker is in step and kept what ran before the interrupt
    assert stream_text(ok(w.run("print(x, 'name' in dir())"))) == "1 False\n"


# ------------------------------------------------- completion and inspection


def test_completion_and_inspection_come_from_the_workers_live_objects(zygote):
    w = zygote.fork()
    ok(w.run("import collections\nmy_table = collections.OrderedDict(a=1)\nmy_tally = 3"))
    names = w.query("complete", "x = my_ta")
    assert {"my_table", "my_tally"} <= set(names["matches"]), names
    assert (names["cursor_start"], names["cursor_end"]) == (4, 9)
    # an attribute of the live object, with the cursor inside a longer cell
    code = "print(1)\nmy_table.move_to\nprint(2)"
    attrs = w.query("complete", code, cursor_pos=code.index("\nprint(2)"))
    assert attrs["matches"] == ["move_to_end"], attrs
    assert attrs["cursor_start"] == code.index("move_to")
    found = w.query("inspect", "my_table", cursor_pos=3)
    assert found["found"] and "OrderedDict" in found["data"]["text/plain"], found
    assert w.query("inspect", "not_defined_anywhere")["found"] is False
    # the worker is in step: the next cell runs
    assert stream_text(ok(w.run("print(my_tally)"))) == "3\n"


def test_user_expressions_are_evaluated_after_a_cell_that_succeeded(zygote):
    w = zygote.fork()
    try:
        asked = {"n": "len(xs)", "bad": "1/0", "html": "__import__('IPython').display.HTML('<b>x</b>')"}
        r = w.run("xs = [1, 2, 3]\nprint('ran')", user_expressions=asked)
        got = [u["data"] for u in of_kind(r, "user_expressions")]
        assert len(got) == 1, r["messages"]
        assert got[0]["n"] == {"status": "ok", "data": {"text/plain": "3"}, "metadata": {}}
        assert got[0]["bad"]["status"] == "error" and got[0]["bad"]["ename"] == "ZeroDivisionError"
        assert got[0]["html"]["data"]["text/html"] == "<b>x</b>"
        # after a failed cell: none, as ipykernel
        r = w.run("raise ValueError('no')", user_expressions={"n": "len(xs)"})
        assert not of_kind(r, "user_expressions")
        w.save()
    finally:
        w.close()
    # a later worker restored nothing: the name an expression reads is brought in
    w2 = zygote.fork()
    try:
        r = w2.run("y = 1", user_expressions={"n": "len(xs) + y"})
        got = [u["data"] for u in of_kind(r, "user_expressions")]
        assert got == [{"n": {"status": "ok", "data": {"text/plain": "4"}, "metadata": {}}}]
        assert r["faults"] == [["xs"]]
    finally:
        w2.close()
