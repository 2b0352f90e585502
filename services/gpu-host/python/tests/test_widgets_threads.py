"""Widgets that restore or stay live, Output widgets that capture, threads that
outlive their cell (issue 43: items 1, 2 and 5)."""

from __future__ import annotations

import json
import re
import time

from helpers import ok, stream_text
from test_comms import comms_of

# Every concrete widget class ipywidgets exports, made with no arguments or
# simple ones; some with values other than their defaults, so that a round trip
# that loses a trait shows.
WIDGETS = """
import datetime, inspect, json
import ipywidgets as W

def wc_area(width, height):
    return width * height

def wc_make(name):
    utc = datetime.timezone.utc
    simple = {
        'Accordion': lambda: W.Accordion(children=[W.Label('a'), W.Label('b')], titles=('1', '2'), selected_index=1),
        'AppLayout': lambda: W.AppLayout(header=W.Button(description='head'), center=W.Label('middle')),
        'Checkbox': lambda: W.Checkbox(value=True, description='tick'),
        'ColorPicker': lambda: W.ColorPicker(value='red'),
        'Combobox': lambda: W.Combobox(options=['ab', 'cd'], value='cd'),
        'DatePicker': lambda: W.DatePicker(value=datetime.date(2024, 5, 6)),
        'DatetimePicker': lambda: W.DatetimePicker(value=datetime.datetime(2024, 1, 2, 3, 4, tzinfo=utc)),
        'Dropdown': lambda: W.Dropdown(options=['red', 'green', 'blue'], value='blue'),
        'FloatLogSlider': lambda: W.FloatLogSlider(value=100, base=10, min=0, max=4),
        'FloatRangeSlider': lambda: W.FloatRangeSlider(value=(0.25, 0.5), min=0, max=1),
        'GridspecLayout': lambda: W.GridspecLayout(2, 2),
        'HTML': lambda: W.HTML(value='<b>bold</b>'),
        'Image': lambda: W.Image(value=b'\\x89PNG\\r\\n\\x1a\\n', format='png', width=20),
        'IntRangeSlider': lambda: W.IntRangeSlider(value=(2, 5), min=0, max=9),
        'IntSlider': lambda: W.IntSlider(value=4, min=1, max=8, description='n'),
        'NaiveDatetimePicker': lambda: W.NaiveDatetimePicker(value=datetime.datetime(2024, 1, 2, 3, 4)),
        'Output': lambda: W.Output(outputs=({'output_type': 'stream', 'name': 'stdout', 'text': 'kept\\n'},)),
        'Play': lambda: W.Play(value=3, max=10),
        # two options with one value: the index says which is selected
        'RadioButtons': lambda: W.RadioButtons(options=[('a', 1), ('b', 1)], index=1),
        'Select': lambda: W.Select(options=['p', 'q'], index=1),
        'SelectMultiple': lambda: W.SelectMultiple(options=['a', 'b', 'c'], value=('a', 'c')),
        'SelectionRangeSlider': lambda: W.SelectionRangeSlider(options=['a', 'b', 'c', 'd'], index=(1, 3)),
        'SelectionSlider': lambda: W.SelectionSlider(options=['a', 'b', 'c'], value='b'),
        'Stack': lambda: W.Stack(children=[W.Label('x'), W.Label('y')], selected_index=1),
        'Tab': lambda: W.Tab(children=[W.Label('x'), W.Label('y')], titles=('one', 'two'), selected_index=1),
        'TagsInput': lambda: W.TagsInput(value=['a', 'b'], allowed_tags=['a', 'b', 'c']),
        'Text': lambda: W.Text(value='hi', placeholder='say'),
        'TimePicker': lambda: W.TimePicker(value=datetime.time(3, 4)),
        'ToggleButtons': lambda: W.ToggleButtons(options=['x', 'y'], value='y'),
        'TwoByTwoLayout': lambda: W.TwoByTwoLayout(top_left=W.Label('tl'), bottom_right=W.Label('br')),
        'interactive': lambda: W.interactive(wc_area, width=(1, 9), height=W.IntSlider(value=4, min=1, max=8)),
    }
    return simple.get(name, getattr(W, name))()

wc_classes = sorted(n for n in dir(W) if inspect.isclass(getattr(W, n)) and issubclass(getattr(W, n), W.Widget))

def wc_sig(w):
    \"\"\"Every trait of a widget, comparable across workers (widgets by model id).\"\"\"
    def plain(v):
        if isinstance(v, W.Widget):
            return 'IPY_MODEL_' + v.model_id
        if isinstance(v, (bytes, memoryview)):
            return bytes(v).hex()
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return repr(v)
    skip = {'comm', 'keys', 'log', '_property_lock', '_states_to_send', '_msg_callbacks'}
    return {k: plain(getattr(w, k)) for k in sorted(w.traits()) if k not in skip}
"""

# The classes whose widgets their traits do not make.
NOT_REBUILT = ["GridspecLayout", "interactive"]

# Widgets that hold what no trait carries: a callback, an observer, an attribute
# a cell set, a class of the notebook's with its own constructor.
HOLDING_MORE = """
wc_clicked = W.Button(description='go')
wc_clicked.on_click(lambda b: print('clicked'))
wc_watched = W.IntSlider()
wc_watched.observe(lambda change: None, 'value')
wc_tagged = W.Label('x')
wc_tagged.note = 'mine'
class WcCustom(W.VBox):
    def __init__(self, n):
        super().__init__(children=[W.Label(str(n))])
wc_custom = WcCustom(3)
@W.interact(x=5)
def wc_interacted(x):
    return x
"""


def test_every_ipywidgets_widget_restores_with_its_traits_or_is_refused_when_saved(zygote):
    # Those that cannot be rebuilt live in a worker of their own here: the
    # checkpoint keeps every variable that shares an object with an unsavable one,
    # and it counts what all widgets hold alike (their class's handlers, the
    # shared logger) as shared, which is not under test here.
    w0 = zygote.fork()
    try:
        ok(w0.run(WIDGETS))
        ok(w0.run(f"for n in {NOT_REBUILT!r}:\n    globals()['wc_' + n] = wc_make(n)\n" + HOLDING_MORE))
        unsavable = w0.save()["ready"]["delta"]["unsavable"]
    finally:
        w0.close()
    refused = {n: why for n, why in unsavable.items() if n.startswith("wc_")}
    # refused when saved (so their worker keeps them), never saved to fail later
    assert sorted(refused) == [
        "wc_GridspecLayout",
        "wc_clicked",
        "wc_custom",
        "wc_interacted",  # a function @interact made a widget of (its .widget)
        "wc_interactive",
        "wc_tagged",
        "wc_watched",
    ]
    assert "interactive.__init__ needs" in refused["wc_interactive"]
    assert "on_click" in refused["wc_clicked"] and "'value'" in refused["wc_watched"]
    assert "(note)" in refused["wc_tagged"] and "own __init__" in refused["wc_custom"]

    w1 = zygote.fork()
    try:
        ok(w1.run(WIDGETS))
        classes = json.loads(stream_text(ok(w1.run("print(json.dumps(wc_classes))"))))
        assert len(classes) > 50 and {"Dropdown", "Output", "interactive"} <= set(classes)
        names = [f"wc_{n}" for n in classes if n not in NOT_REBUILT] + ["wc_linked"]
        make = f"for n in {classes!r}:\n    if n not in {NOT_REBUILT!r}:\n        globals()['wc_' + n] = wc_make(n)\n"
        ok(w1.run(make + "wc_linked = W.jslink((W.IntSlider(), 'value'), (W.IntText(), 'value'))"))
        sigs = f"print(json.dumps({{n: wc_sig(globals()[n]) for n in {names!r}}}))"
        before = json.loads(stream_text(ok(w1.run(sigs))))
        unsavable = w1.save()["ready"]["delta"]["unsavable"]
        assert not unsavable, unsavable
    finally:
        w1.close()
    w2 = zygote.fork()
    try:
        restored = w2.restore([*names, "W", "json", "wc_sig"])
        assert restored["ok"], restored["errors"]
        r = ok(w2.run(sigs))
        assert not comms_of(r, "comm_open"), "the client holds every model: no new comm_open"
        after = json.loads(stream_text(r))
        for name in names:
            assert after[name] == before[name], name
        # the selections read as they did, and work on from there
        r = ok(
            w2.run("wc_Dropdown.value = 'green'\nprint(wc_Dropdown.index, wc_Dropdown.value, wc_RadioButtons.index)")
        )
        assert stream_text(r) == "1 green 1\n"
    finally:
        w2.close()


def test_output_inside_an_output_widget_goes_to_the_widget_not_the_cell(zygote):
    w1 = zygote.fork()
    try:
        r = ok(
            w1.run(
                "import ipywidgets as W\n"
                "from IPython.display import display\n"
                "log = W.Output()\n"
                "print('the cell')\n"
                "with log:\n"
                "    print('in the widget')\n"
                "    display('shown in it')\n"
                "@log.capture()\n"
                "def noisy():\n"
                "    print('from noisy')\n"
                "noisy()\n"
                "with log:\n"
                "    1 / 0\n"
                "print('the cell again')"
            )
        )
        # as with ipykernel and nbclient: the cell keeps only its own output
        assert stream_text(r) == "the cell\nthe cell again\n"
        assert [o["output_type"] for o in r["outputs"]] == ["stream", "stream"]
        # the widget has the rest, and the client is told (as the frontend syncs it)
        r = ok(
            w1.run(
                "print([(o['output_type'], o.get('text') or o.get('ename') or o['data']['text/plain'])\n"
                "       for o in log.outputs])"
            )
        )
        assert stream_text(r) == (
            "[('stream', 'in the widget\\n'), ('display_data', \"'shown in it'\"), "
            "('stream', 'from noisy\\n'), ('error', 'ZeroDivisionError')]\n"
        )
        assert ok(w1.run("print(repr(log.msg_id))"))["outputs"][0]["text"] == "''\n"
        w1.save()
    finally:
        w1.close()
    # in another worker (a GPU cell's), the widget captures on, after what it has
    w2 = zygote.fork()
    try:
        assert w2.restore(["log", "W"])["ok"]
        r = ok(w2.run("log.clear_output()\nwith log:\n    print('one')\nwith log:\n    print('two')\nlen(log.outputs)"))
        assert not stream_text(r)
        sent = [c["content"]["data"]["state"] for c in comms_of(r, "comm_msg")]
        assert {"outputs": [{"output_type": "stream", "name": "stdout", "text": "one\ntwo\n"}]} in sent
    finally:
        w2.close()


def test_a_callback_captured_by_an_output_widget_prints_into_it(zygote):
    # a button's handler, run between cells for the client's click
    w = zygote.fork()
    try:
        code = (
            "import ipywidgets as W\nout = W.Output()\nb = W.Button()\n"
            "@out.capture()\ndef clicked(_):\n    print('clicked')\nb.on_click(clicked)\nprint(b.model_id)"
        )
        bid = stream_text(ok(w.run(code))).strip()
        answer = w.comm("comm_msg", {"comm_id": bid, "data": {"method": "custom", "content": {"event": "click"}}})
        assert not stream_text(answer), answer["messages"]
        sent = [c["content"]["data"].get("state", {}) for c in comms_of(answer, "comm_msg")]
        assert {"outputs": [{"output_type": "stream", "name": "stdout", "text": "clicked\n"}]} in sent
    finally:
        w.close()


def test_a_thread_prints_into_its_own_cell_only_and_its_worker_serves_on(zygote):
    w = zygote.fork()
    try:
        code = (
            "import threading\n"
            "go, done = threading.Event(), threading.Event()\n"
            "def job():\n"
            "    print('thread: in its cell')\n"
            "    go.wait(10)\n"
            "    print('thread: after its cell')\n"
            "    done.set()\n"
            "t = threading.Thread(target=job)\n"
            "t.start()\n"
            "t.join(0.5)\n"
            "print('cell one')"
        )
        r = ok(w.run(code))
        assert stream_text(r) == "thread: in its cell\ncell one\n"
        # while a later cell runs, the thread's output is no output of that cell
        # (ipykernel sends it with its own cell's parent; nbclient records none)
        r = ok(w.run("print('before')\ngo.set()\ndone.wait(10)\nt.join(10)\nprint('after')"))
        assert stream_text(r) == "before\nafter\n"
        assert "thread: after its cell" in zygote.log_text()  # not lost: logged
    finally:
        w.close()


def test_threads_and_the_cell_print_at_once_and_every_line_arrives(zygote):
    # big lines go out as soon as they are written, each in a frame of its own,
    # from four threads at once: frames must not interleave on the socket
    w = zygote.fork()
    try:
        code = (
            "import threading\n"
            "def chatter(k):\n"
            "    for i in range(40):\n"
            "        print(f'<{k} {i}>' + 'x' * 200_000)\n"
            "ts = [threading.Thread(target=chatter, args=(k,)) for k in 'abc']\n"
            "for t in ts:\n"
            "    t.start()\n"
            "chatter('m')\n"
            "for t in ts:\n"
            "    t.join()"
        )
        # print() writes its text and its newline apart: threads may interleave
        # them, as in any kernel; none of the text is lost
        text = stream_text(ok(w.run(code)))
        assert sorted(re.findall(r"<\w \d+>", text)) == sorted(f"<{k} {i}>" for k in "abcm" for i in range(40))
        assert len(text) == 4 * 40 * (len("<a 0>") + 200_001) + sum(len(str(i)) - 1 for i in range(40)) * 4
        assert stream_text(ok(w.run("print('still served')"))) == "still served\n"
    finally:
        w.close()


def test_a_widget_a_thread_changes_between_cells_reaches_the_client_with_the_next_cell(zygote):
    w = zygote.fork()
    try:
        code = (
            "import threading, ipywidgets as W\n"
            "bar = W.IntProgress(max=10)\n"
            "for i in range(1, 4):\n"
            "    threading.Timer(0.1 * i, setattr, (bar, 'value', i)).start()\n"
            "print(bar.model_id)"
        )
        cid = stream_text(ok(w.run(code))).strip()
        time.sleep(1.0)
        r = ok(w.run("bar.value"))
        first = r["messages"][0]
        # the updates made meanwhile, as one, before the cell's own output
        assert "comm" in first and first["comm"]["content"]["comm_id"] == cid, r["messages"]
        assert first["comm"]["content"]["data"]["state"] == {"value": 3}
    finally:
        w.close()
