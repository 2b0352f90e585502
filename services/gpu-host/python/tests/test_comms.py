"""Comms and ipywidgets in workers (ADR 33)."""

from __future__ import annotations

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def comms_of(outputs: list[dict], msg_type: str) -> list[dict]:
    return [o for o in outputs if o["output_type"] == "comm" and o["msg_type"] == msg_type]


def stdout(outputs: list[dict]) -> str:
    return "".join(o["text"] for o in outputs if o["output_type"] == "stream" and o["name"] == "stdout")


def update(comm_id: str, **state) -> dict:
    return {"comm_id": comm_id, "data": {"method": "update", "state": state, "buffer_paths": []}}


def slider_id(outputs: list[dict]) -> str:
    """The model id of the IntSlider a cell displayed (its comm_open and view agree)."""
    opened = [
        o for o in comms_of(outputs, "comm_open") if o["content"]["data"]["state"]["_model_name"] == "IntSliderModel"
    ]
    assert len(opened) == 1, outputs
    view = [o for o in outputs if o["output_type"] in ("display_data", "execute_result") and WIDGET_VIEW in o["data"]]
    assert view[-1]["data"][WIDGET_VIEW]["model_id"] == opened[0]["content"]["comm_id"]
    assert opened[0]["content"]["target_name"] == "jupyter.widget"
    return opened[0]["content"]["comm_id"]


def test_a_slider_is_shown_and_its_value_set_in_the_browser_is_read_back(zygote):
    w = zygote.fork()
    try:
        code = "import ipywidgets as W\ns = W.IntSlider(value=3)\ns.observe(lambda c: print('now', c.new), 'value')\ns"
        r = w.run(code)
        assert r["finished"]["status"] == "ok", r
        cid = slider_id(r["outputs"])
        assert comms_of(r["outputs"], "comm_open")[-1]["content"]["data"]["state"]["value"] == 3
        info = w.comm("comm_info_request", {"target_name": "jupyter.widget"})
        assert info["reply"]["comms"][cid] == {"target_name": "jupyter.widget"}
        # the browser moves the slider: the observer runs, what it prints comes back
        answer = w.comm("comm_msg", update(cid, value=7))
        assert stdout(answer["outputs"]) == "now 7\n"
        assert stdout(w.run("print(s.value)")["outputs"]) == "7\n"
        # set in a cell: the client is told
        r = w.run("s.value = 9")
        sent = [o["content"]["data"] for o in comms_of(r["outputs"], "comm_msg")]
        assert {"method": "update", "state": {"value": 9}, "buffer_paths": []} in sent
    finally:
        w.close()


def test_a_comm_open_to_a_target_the_worker_lacks_is_closed(zygote):
    w = zygote.fork()
    try:
        answer = w.comm("comm_open", {"comm_id": "abc", "target_name": "no.such.target", "data": {}})
        # closed, and the manager's complaint goes to the log, not the notebook
        assert [(o["output_type"], o["content"]["comm_id"]) for o in answer["outputs"]] == [("comm", "abc")]
        assert comms_of(answer["outputs"], "comm_close")
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
        assert stdout(w1.run("s = box.children[0]\ns.value = 4\nprint(s.model_id)")["outputs"])
        cid = stdout(w1.run("print(s.model_id)")["outputs"]).strip()
        saved = w1.save()
        assert not saved["ready"]["delta"]["unsavable"], saved["ready"]["delta"]["unsavable"]
    finally:
        w1.close()
    w2 = zygote.fork()
    try:
        assert w2.restore(["box", "s"])["ok"]
        r = w2.run("print(s.value, s.description, s.model_id, box.children[0] is s)")
        assert stdout(r["outputs"]) == f"4 n {cid} True\n"
        assert not comms_of(r["outputs"], "comm_open"), "the client holds the model: no new comm_open"
        # the browser's changes reach the widget in the worker that holds it now
        w2.comm("comm_msg", update(cid, value=8))
        assert stdout(w2.run("print(s.value)")["outputs"]) == "8\n"
    finally:
        w2.close()
