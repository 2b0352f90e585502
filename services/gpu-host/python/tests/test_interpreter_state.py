"""What a cell registers with the interpreter rather than as a variable travels
with the session (issue 43, items 3 and 4): import finders and path hooks, input
and AST transformers, display printers (re-keyed to the class a later worker
restored), a library's printers (sympy), event callbacks, shell settings and the
output history; and the shell looks like ipykernel's (its magics, its cell file
names, LooseLeaf's magics out of %lsmagic). Each test runs cells in one worker,
saves, and checks the behaviour in a fresh worker that restored only what the
next cell reads."""

import re

from helpers import of_kind, of_type, ok, result_text, stream_text

FINDER = """
import sys, importlib.abc, importlib.util
class Virtual(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name.startswith('virtual_') else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        module.origin_name = module.__name__.upper()
sys.meta_path.insert(0, Virtual())
"""


def test_an_import_finder_a_cell_installed_serves_later_workers(zygote):
    w1 = zygote.fork()
    ok(w1.run(FINDER))
    assert result_text(w1.run("import virtual_alpha\nvirtual_alpha.origin_name")) == "'VIRTUAL_ALPHA'"
    w1.save()

    # the closure has `sys` only: the finder comes with the ambient state, reads
    # `importlib` as in the kernel, and the module it served is imported again
    w2 = zygote.fork()
    assert w2.restore(["sys"])["ok"]
    r = w2.run("import virtual_beta\nvirtual_beta.origin_name, 'virtual_alpha' in sys.modules")
    assert result_text(r) == "('VIRTUAL_BETA', True)"
    # first on the path, where the cell put it
    assert result_text(w2.run("type(sys.meta_path[0]).__name__")) == "'Virtual'"
    w2.save()

    # a module variable it served restores through it
    w3 = zygote.fork()
    assert w3.restore(["virtual_alpha"], imports=["virtual_alpha"])["ok"]
    assert result_text(w3.run("virtual_alpha.origin_name")) == "'VIRTUAL_ALPHA'"


PATH_HOOK = """
import sys, importlib.abc, importlib.util
class Remote(importlib.abc.PathEntryFinder, importlib.abc.Loader):
    def __init__(self, entry):
        if not entry.startswith('remote:'):
            raise ImportError(entry)
        self.entry = entry
    def find_spec(self, name, target=None):
        return importlib.util.spec_from_loader(name, self) if name.startswith('from_remote') else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        module.where = self.entry
sys.path_hooks.insert(0, Remote)
sys.path.append('remote:shelf')
sys.path_importer_cache.clear()
"""


def test_a_path_hook_a_cell_installed_serves_later_workers(zygote):
    w1 = zygote.fork()
    ok(w1.run(PATH_HOOK))
    assert result_text(w1.run("import from_remote_a\nfrom_remote_a.where")) == "'remote:shelf'"
    w1.save()
    w2 = zygote.fork()
    assert w2.restore([])["ok"]
    assert result_text(w2.run("import from_remote_b\nfrom_remote_b.where")) == "'remote:shelf'"


def test_transformers_a_cell_registered_shape_later_cells(zygote):
    w1 = zygote.fork()
    code = (
        "import ast\nip = get_ipython()\n"
        "def shout(lines):\n    return [l.replace('whisper', 'SHOUT') for l in lines]\n"
        "ip.input_transformers_cleanup.append(shout)\n"
        "class Double(ast.NodeTransformer):\n"
        "    def visit_Constant(self, node):\n"
        "        return ast.Constant(node.value * 2) if type(node.value) is int else node\n"
        "ip.ast_transformers.append(Double())"
    )
    ok(w1.run(code))
    ref = result_text(w1.run("'whisper', 21"))
    assert ref == "('SHOUT', 42)"
    w1.save()
    w2 = zygote.fork()
    assert w2.restore([])["ok"]
    assert result_text(w2.run("'whisper', 21")) == ref


FORMATTERS = """
from fractions import Fraction
ip = get_ipython()
plain = ip.display_formatter.formatters['text/plain']
latex = ip.display_formatter.formatters['text/latex']
plain.for_type(Fraction, lambda f, p, cycle: p.text(f'{f.numerator} over {f.denominator}'))
class Vec:
    def __init__(self, *xs):
        self.xs = xs
latex.for_type(Vec, lambda v: '$(' + ', '.join(map(str, v.xs)) + ')$')
plain.for_type_by_name('decimal', 'Decimal', lambda d, p, cycle: p.text(f'dec {d}'))
v = Vec(1, 2)
"""


def test_display_printers_apply_to_the_classes_a_later_worker_restored(zygote):
    w1 = zygote.fork()
    ok(w1.run(FORMATTERS))
    w1.save()

    # the class is restored by value, a new class object: the printer follows it
    w2 = zygote.fork()
    assert w2.restore(["Vec", "Fraction"])["ok"]
    r = ok(w2.run("Vec(3, 4, 5)"))
    assert of_type(r, "execute_result")[0]["data"]["text/latex"] == "$(3, 4, 5)$"
    assert result_text(w2.run("Fraction(3, 4)")) == "3 over 4"
    # a printer registered by name applies once the cell imports its module
    assert result_text(w2.run("import decimal\ndecimal.Decimal('1.5')")) == "dec 1.5"

    # an instance alone: its class arrives with it, unnamed, and is formatted too
    w3 = zygote.fork()
    assert w3.restore(["v"])["ok"]
    r = ok(w3.run("v"))
    assert of_type(r, "execute_result")[0]["data"]["text/latex"] == "$(1, 2)$"


def test_the_shell_and_its_parts_restore_as_the_live_ones(zygote):
    w1 = zygote.fork()
    ok(w1.run(FORMATTERS))
    w1.save()
    w2 = zygote.fork()
    assert w2.restore(["ip", "plain", "Fraction"])["ok"]
    r = w2.run("plain is get_ipython().display_formatter.formatters['text/plain'] and ip is get_ipython()")
    assert result_text(r) == "True"
    # registering through the restored part registers with this worker's shell
    r = w2.run("plain.for_type(Fraction, lambda f, p, cycle: p.text('a fraction'))\nFraction(1, 3)")
    assert result_text(r) == "a fraction"


def test_sympy_printing_stays_set_up_in_later_workers(host):
    z = host.zygote(["numpy"])
    w1 = z.fork()
    ok(w1.run("from sympy import symbols, init_printing\ninit_printing()\nx = symbols('x')"))
    ref = of_type(ok(w1.run("x**2/2, 1.5")), "execute_result")[0]["data"]
    assert "text/latex" in ref and "─" in ref["text/plain"]
    w1.save()

    # carried through a worker that never touched sympy
    w2 = z.fork()
    assert w2.restore([])["ok"]
    ok(w2.run("y = 1"))
    w2.save()
    w3 = z.fork()
    assert w3.restore(["x"], imports=["sympy"])["ok"]
    got = of_type(ok(w3.run("x**2/2, 1.5")), "execute_result")[0]["data"]
    assert got["text/plain"] == ref["text/plain"] and got["text/latex"] == ref["text/latex"]


CALLBACK = """
seen = []
def after(result):
    seen.append(result.execution_count)
    print('after cell', result.execution_count)
get_ipython().events.register('post_run_cell', after)
"""


def test_a_post_run_cell_callback_runs_after_cells_in_later_workers(zygote):
    w1 = zygote.fork()
    r = ok(w1.run(CALLBACK))
    assert stream_text(r) == "after cell 1\n"
    w1.save()

    # `seen` and `after` are not in the closure: the callback runs, what it prints
    # is the cell's, and the list it appends to is the session's
    w2 = zygote.fork()
    assert w2.restore([])["ok"]
    assert stream_text(ok(w2.run("x = 1"))) == "after cell 2\n"
    w2.save()
    w3 = zygote.fork()
    assert w3.restore(["seen"])["ok"]
    assert stream_text(ok(w3.run("print(seen)"))) == "[1, 2]\nafter cell 3\n"
    w3.save()

    # restored by name, it is the very function: unregister finds it
    w4 = zygote.fork()
    assert w4.restore(["after"])["ok"]
    assert stream_text(ok(w4.run("get_ipython().events.unregister('post_run_cell', after)"))) == ""
    w4.save()
    w5 = zygote.fork()
    assert w5.restore([])["ok"]
    assert stream_text(ok(w5.run("y = 2"))) == ""


def test_what_cannot_be_carried_is_named_once_in_the_cell_that_made_it(zygote):
    w1 = zygote.fork()
    code = (
        "import threading\nclass Tracker:\n    def __init__(self):\n        self.lock = threading.Lock()\n"
        "    def after(self, result):\n        pass\n"
        "tracker = Tracker()\nget_ipython().events.register('post_run_cell', tracker.after)"
    )
    r = ok(w1.run(code))
    note = stream_text(r, "stderr")
    assert "post_run_cell callback Tracker.after cannot be kept for later cells" in note
    assert "lock" in note
    assert stream_text(ok(w1.run("z = 1")), "stderr") == ""  # once
    w1.save()  # and the save does not fail on it


SETTINGS = """
import math
ip = get_ipython()
ip.ast_node_interactivity = 'all'
"""


def test_shell_settings_a_cell_changed_hold_in_later_workers(zygote):
    w1 = zygote.fork()
    ok(w1.run(SETTINGS))
    ok(w1.run("%xmode Minimal"))
    ok(w1.run("%precision 3"))
    ok(w1.run("ip.display_formatter.formatters['text/plain'].max_seq_length = 3"))
    ref_tb = of_type(w1.run("def inner(x):\n    return 1 / x\ninner(0)"), "error")[0]["traceback"]
    w1.save()

    w2 = zygote.fork()
    assert w2.restore(["math"])["ok"]
    r = w2.run("def inner(x):\n    return 1 / x\ninner(0)")
    assert of_type(r, "error")[0]["traceback"] == ref_tb  # Minimal: the last line only
    assert len(ref_tb) == 1
    r = ok(w2.run("math.pi\nlist(range(10))"))
    assert [o["data"]["text/plain"] for o in of_type(r, "execute_result")] == ["3.142", "[0, 1, 2, ...]"]
    w2.save()

    # a worker kept from before follows the session's later changes
    ok(w2.run("%xmode Context"))
    w2.save()
    assert w1.restore([], drop=[])["ok"]
    r = w1.run("def inner(x):\n    return 1 / x\ninner(0)")
    assert len(of_type(r, "error")[0]["traceback"]) > 1


def test_config_of_a_formatter_applies_until_the_first_output_as_in_ipykernel(zygote):
    # ipykernel builds its formatters at the first output, from the config then
    w1 = zygote.fork()
    ok(w1.run("%config PlainTextFormatter.max_seq_length = 3"))
    assert result_text(w1.run("list(range(10))")) == "[0, 1, 2, ...]"
    ok(w1.run("%config PlainTextFormatter.max_seq_length = 5"))  # built by now: no effect
    w1.save()
    w2 = zygote.fork()
    assert w2.restore([])["ok"]
    assert result_text(w2.run("list(range(10))")) == "[0, 1, 2, ...]"

    # a session whose first output came before: its %config does nothing there
    w3 = zygote.fork()
    ok(w3.run("1"))
    ok(w3.run("%config PlainTextFormatter.max_seq_length = 3"))
    assert result_text(w3.run("list(range(5))")) == "[0, 1, 2, 3, 4]"


def test_output_history_is_the_sessions_in_every_worker(zygote):
    w1 = zygote.fork()
    ok(w1.run("'first'"))
    w1.save()
    # a cell without a result on a fresh worker leaves `_` as it was (the fresh
    # shell's '' placeholders are not saved over it)
    w2 = zygote.fork()
    assert w2.restore([])["ok"]
    ok(w2.run("x = 1"))
    w2.save()
    # a result rotates the session's `_` into `__`, though the closure lacked it
    w3 = zygote.fork()
    assert w3.restore([])["ok"]
    ok(w3.run("'third'"))
    w3.save()
    w4 = zygote.fork()
    assert w4.restore(["_", "__", "___", "_1"])["ok"]
    expected = "('third', 'first', '', 'first', \"'first'\", \"'third'\")"
    assert result_text(w4.run("_, __, ___, Out[1], In[1], _i3")) == expected


def test_an_underscore_a_cell_assigned_is_left_alone_by_later_results(zygote):
    w1 = zygote.fork()
    ok(w1.run("'first'"))
    ok(w1.run("_ = 'mine'"))
    w1.save()
    w2 = zygote.fork()
    assert w2.restore(["_"])["ok"]
    ok(w2.run("'second'"))
    assert result_text(w2.run("_")) == "'mine'"


def test_ipykernel_magics_exist_and_looseleaf_magics_stay_out_of_lsmagic(zygote):
    w = zygote.fork()
    r = ok(w.run("%connect_info"))
    assert "UserWarning: Could not get connection info: RuntimeError(" in stream_text(r, "stderr")
    assert ok(w.run("%qtconsole"))["messages"] == []  # as under nbclient: nothing opens
    r = ok(w.run("%autosave 0"))
    assert [o["output_type"] for o in r["outputs"]] == ["display_data", "stream"]
    listing = ok(w.run("%lsmagic"))
    text = of_type(listing, "execute_result")[0]["data"]["text/plain"]
    as_json = of_type(listing, "execute_result")[0]["data"]["application/json"]
    for magic in ("%connect_info", "%qtconsole", "%autosave", "%edit", "%ed", "%less", "%man", "%clear"):
        assert re.search(rf"(^|\s){magic}(\s|$)", text), magic
    assert "%%gpu" not in text and "%%cpu" not in text and "gpu" not in as_json["cell"]
    assert "%%gpu" in result_text(ok(w.run("str(get_ipython().run_line_magic('lsmagic', '--all'))")))
    # asked for, it is there: its help, and a malformed placement line explained
    assert "placement override" in of_kind(ok(w.run("%%gpu?")), "pager")[0]["data"]["text/plain"]


def test_cells_are_named_as_ipykernel_names_them(zygote):
    w = zygote.fork()
    err = of_type(w.run("collections."), "error")[0]
    assert re.fullmatch(r"invalid syntax \(\d+\.py, line 1\)", err["evalue"])
    r = ok(w.run("import warnings\nwarnings.warn('careful')"))
    assert re.match(rf"/tmp/ipykernel_{w.pid}/\d+\.py:2: UserWarning: careful", stream_text(r, "stderr"))
    # the same name ipykernel gives the same code
    from ipykernel.compiler import murmur2_x86

    code = "import warnings\nwarnings.warn('careful')"
    assert f"/{murmur2_x86(code, 0xC70F6907)}.py:2" in stream_text(r, "stderr")
