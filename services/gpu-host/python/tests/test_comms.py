"""Comms and ipywidgets in workers (ADR 33)."""

from __future__ import annotations

from helpers import of_kind, outputs, stream_text

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def comms_of(r: dict, msg_type: str) -> list[dict]:
    """The comm messages to the client of ``msg_type`` that a run or a comm answer sent."""
    return [c for c in of_kind(r, "comm") if c["msg_type"] == msg_type]


def update(comm_id: str, **state) -> dict:
    return {"comm_id": comm_id, "data": {"method": "update", "state": state, "buffer_paths": []}}


def slider_id(r: dict) -> str:
    """The model id of the IntSlider a cell displayed (its comm_open and view agree)."""
    opened = [c for c in comms_of(r, "comm_open") if c["content"]["data"]["state"]["_model_name"] == "IntSliderModel"]
    assert len(opened) == 1, r["messages"]
    view = [
        o for o in outputs(r) if o["output_type"] in ("display_data", "execute_result") and WIDGET_VIEW in o["data"]
    ]
    assert view[-1]["data"][WIDGET_VIEW]["model_id"] == opened[0]["content"]["comm_id"]
    assert opened[0]["content"]["target_name"] == "jupyter.widget"
    return opened[0]["content"]["comm_id"]


def test_a_slider_is_shown_and_its_value_set_in_the_browser_is_read_back(zygote):
    w = zygote.fork()
    try:
        code = "import ipywidgets as W\ns = W.IntSlider(value=3)\ns.observe(lambda c: print('now', c.new), 'value')\ns"
        r = w.run(code)
        assert r["finished"]["status"] == "ok", r
        cid = slider_id(r)
        assert comms_of(r, "comm_open")[-1]["content"]["data"]["state"]["value"] == 3
        info = w.comm("comm_info_request", {"target_name": "jupyter.widget"})
        assert info["reply"]["comms"][cid] == {"target_name": "jupyter.widget"}
        # the browser moves the slider: the observer runs, what it prints comes back
        answer = w.comm("comm_msg", update(cid, value=7))
        assert stream_text(answer) == "now 7\n"
        assert stream_text(w.run("print(s.value)")) == "7\n"
        # set in a cell: the client is told
        r = w.run("s.value = 9")
        sent = [c["content"]["data"] for c in comms_of(r, "comm_msg")]
        assert {"method": "update", "state": {"value": 9}, "buffer_paths": []} in sent
    finally:
        w.close()


def test_a_comm_open_to_a_target_the_worker_lacks_is_closed(zygote):
    w = zygote.fork()
    try:
        answer = w.comm("comm_open", {"comm_id": "abc", "target_name": "no.such.target", "data": {}})
        # closed, and the manager's complaint goes to the log, not the notebook
        assert [(kind, body["content"]["comm_id"]) for m in answer["messages"] for kind, body in m.items()] == [
            ("comm", "abc")
        ]
        assert comms_of(answer, "comm_close")
        assert w.comm("comm_info_request", {})["reply"]["comms"] == {}
        bad = w.comm("execute_request", {})
        assert bad["reply"]["status"] == "error" and "not a comm message" in bad["reply"]["evalue"]
    finally:
        w.close()


def test_a_widget_outlives_its_worker_on_its_model_id(zygote):
    # a GPU cell's worker ends after its cell; the next worker restores the widget
    w1 = zygote.fork()
    try:
        r = w1.run("import ipywidgets as W\nbox = W.VBox([W.IntSlider(value=3, description='n')])\nbox")
        assert r["finished"]["status"] == "ok", r
        assert stream_text(w1.run("s = box.children[0]\ns.value = 4\nprint(s.model_id)"))
        cid = stream_text(w1.run("print(s.model_id)")).strip()
        saved = w1.save()
        assert not saved["ready"]["delta"]["unsavable"], saved["ready"]["delta"]["unsavable"]
    finally:
        w1.close()
    w2 = zygote.fork()
    try:
        assert w2.restore(["box", "s"])["ok"]
        r = w2.run("print(s.value, s.description, s.model_id, box.children[0] is s)")
        assert stream_text(r) == f"4 n {cid} True\n"
        assert not comms_of(r, "comm_open"), "the client holds the model: no new comm_open"
        # the browser's changes reach the widget in the worker that holds it now
        w2.comm("comm_msg", update(cid, value=8))
        assert stream_text(w2.run("print(s.value)")) == "8\n"
    finally:
        w2.close()


def test_a_save_holds_what_a_comm_changed_after_the_cell_finished(zygote):
    """The worker builds a cell's save as soon as the cell finishes; a comm
    handled before the host asks for it changes the state, so the save is built
    again with the change."""
    w = zygote.fork()
    try:
        code = (
            "import ipywidgets as W\ns = W.IntSlider(value=3)\nseen = []\n"
            "s.observe(lambda c: seen.append(c.new), 'value')\ns"
        )
        cid = slider_id(w.run(code))
        w.comm("comm_msg", update(cid, value=7))
        assert w.save()["committed"]["ok"]
        w2 = zygote.fork()
        try:
            assert w2.restore(["seen"])["ok"]
            assert stream_text(w2.run("print(seen)")) == "[7]\n"
        finally:
            w2.close()
    finally:
        w.close()
