"""Drive an installed LooseLeaf kernel as Jupyter clients do (jupyter_client), and
print one JSON line of what it answered; tests/kernel.rs asserts on it.

Usage: kernel_probe.py KERNEL_NAME (with JUPYTER_PATH naming where it is installed)
"""

import json
import signal
import sys
import time

from jupyter_client.manager import start_new_kernel

TIMEOUT = 120


def reply_to(kc, msg_id):
    """The shell reply to `msg_id` (replies to earlier requests are skipped)."""
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


def run(kc, code, **kw):
    """Execute `code`; return (reply content, [(msg_type, content)] on iopub)."""
    return finish(kc, kc.execute(code, **kw))


def finish(kc, msg_id):
    """The reply and iopub messages of the execution `msg_id`."""
    outputs = published(kc, msg_id)
    return reply_to(kc, msg_id)["content"], outputs


def published(kc, msg_id):
    """[(msg_type, content)] the kernel published on iopub for request `msg_id`,
    until it went idle."""
    outputs = []
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "status" and msg["content"]["execution_state"] == "idle":
            return outputs
        if kind != "status":
            outputs.append((kind, msg["content"]))


def wait_for_output(kc, msg_id):
    """Wait until the cell `msg_id` printed: it runs in its worker."""
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            return
    raise TimeoutError("the cell never printed")


def send_comm(kc, msg_type, content):
    """Send a client's comm message on the shell channel (as a widget manager
    does); return [(msg_type, content)] the kernel published for it."""
    msg = kc.session.msg(msg_type, content)
    kc.shell_channel.send(msg)
    return published(kc, msg["header"]["msg_id"])


def slider_of(outputs):
    """The comm id of the IntSlider a cell showed, if its view names it."""
    opened = [
        c["comm_id"]
        for k, c in outputs
        if k == "comm_open" and c["data"]["state"].get("_model_name") == "IntSliderModel"
    ]
    views = [
        c["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
        for k, c in outputs
        if k in ("display_data", "execute_result") and "application/vnd.jupyter.widget-view+json" in c["data"]
    ]
    return opened[0] if len(opened) == 1 and views == opened else None


def update(comm_id, **state):
    return {"comm_id": comm_id, "data": {"method": "update", "state": state, "buffer_paths": []}}


def widgets(kc):
    """ipywidgets through the kernel (ADR 33): a CPU cell's slider and a GPU cell's."""
    seen = {}
    code = "import ipywidgets as W\ns = W.IntSlider(value=3)\ns.observe(lambda c: print('now', c['new']), 'value')\ns"
    _, outs = run(kc, code)
    cid = slider_of(outs)
    seen["cpu_shown"] = cid is not None
    info = reply_to(kc, kc.comm_info(target_name="jupyter.widget"))["content"]
    seen["comm_info"] = info["comms"].get(cid)
    seen["observer"] = text(send_comm(kc, "comm_msg", update(cid, value=7)))
    seen["cpu_read_back"] = text(run(kc, "print(s.value)")[1])
    # a GPU cell's slider: its worker ends with the cell; the CPU cell that reads
    # it next restores it on its model id and serves it from then on
    _, outs = run(kc, "%%gpu\nimport ipywidgets as W\ng = W.IntSlider(value=5)\ng.value = 6\ng")
    gid = slider_of(outs)
    seen["gpu_shown"] = gid is not None
    _, outs = run(kc, f"print(g.value, g.model_id == {gid!r})")
    seen["gpu_read_back"] = text(outs)
    seen["gpu_reopened"] = [k for k, _ in outs if k == "comm_open"]
    send_comm(kc, "comm_msg", update(gid, value=11))
    seen["gpu_moved"] = text(run(kc, "print(g.value)")[1])
    closed = send_comm(kc, "comm_open", {"comm_id": "c0ffee", "target_name": "no.such.target", "data": {}})
    seen["unknown_target"] = [[k, c.get("comm_id")] for k, c in closed]
    return seen


def execute_as_cell(kc, code, cell_id):
    """Execute `code` as JupyterLab does, naming its cell; return (reply, outputs)."""
    content = {"code": code, "silent": False, "store_history": True, "user_expressions": {}}
    content.update({"allow_stdin": False, "stop_on_error": True})
    msg = kc.session.msg("execute_request", content, metadata={"cellId": cell_id})
    kc.shell_channel.send(msg)
    outputs = published(kc, msg["header"]["msg_id"])
    return reply_to(kc, msg["header"]["msg_id"]), outputs


def edits(kc):
    """What the JupyterLab extension does: stream a cell's text as it is typed on
    the `looseleaf` comm, then Run it; and a cell run with no edits before it."""
    comm_id = "e0f1"
    opened = send_comm(kc, "comm_open", {"comm_id": comm_id, "target_name": "looseleaf", "data": {}})
    execute_as_cell(kc, "x = 5", "first")
    code = "y = x * 2\nprint(y)"
    for i in range(1, len(code) + 1):
        edit = {"action": "edit", "cell_id": "typed", "code": code[:i]}
        send_comm(kc, "comm_msg", {"comm_id": comm_id, "data": edit})
        time.sleep(0.05)  # 20 characters a second
    bad = send_comm(kc, "comm_msg", {"comm_id": comm_id, "data": {"action": "edit"}})
    time.sleep(3)  # the user reads what they typed: the worker is prepared meanwhile
    typed, typed_outs = execute_as_cell(kc, code, "typed")
    cold, _ = execute_as_cell(kc, "z = x + 1", "untyped")
    # a pinned cell runs where it is pinned (every cell is a GPU cell here), and
    # its own placement line wins over the pin
    pin = {"action": "pin", "cell_id": "pinned", "device": "cpu"}
    send_comm(kc, "comm_msg", {"comm_id": comm_id, "data": pin})
    pinned, pinned_outs = execute_as_cell(kc, "w = x + 3\nprint(w)", "pinned")
    own, _ = execute_as_cell(kc, "%%gpu\nw = x + 4", "pinned")
    send_comm(kc, "comm_msg", {"comm_id": comm_id, "data": dict(pin, device=None)})
    unpinned, _ = execute_as_cell(kc, "w = x + 5", "pinned")
    return {
        "pinned": pinned["metadata"].get("looseleaf"),
        "pinned_output": text(pinned_outs),
        "own_line": own["metadata"].get("looseleaf"),
        "unpinned": unpinned["metadata"].get("looseleaf"),
        "opened": opened,
        "bad": bad,
        "typed": typed["metadata"].get("looseleaf"),
        "typed_output": text(typed_outs),
        "cold": cold["metadata"].get("looseleaf"),
    }


def text(outputs):
    out = []
    for kind, c in outputs:
        if kind == "stream":
            out.append(c["text"])
        elif kind in ("execute_result", "display_data"):
            out.append(c["data"].get("text/plain", ""))
    return "".join(out)


def main():
    name = sys.argv[1]
    km, kc = start_new_kernel(kernel_name=name, startup_timeout=TIMEOUT)
    seen = {}
    if len(sys.argv) > 2 and sys.argv[2] == "--one-cell":
        # only what one cell is answered (a kernel whose frontend is not there)
        try:
            reply, outs = run(kc, "1 + 1")
            print(json.dumps({"reply": reply, "outputs": outs}))
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)  # a shutdown_request: the kernel stops its cluster
        return
    probes = {"--edits": edits, "--widgets": widgets}
    if len(sys.argv) > 2 and sys.argv[2] in probes:
        try:
            print(json.dumps(probes[sys.argv[2]](kc)))
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)
        return
    if len(sys.argv) > 2 and sys.argv[2] == "--complete":
        # completion and inspection from the session's live objects (its CPU worker)
        try:
            run(kc, "import collections\nmy_table = collections.OrderedDict(a=1)\nmy_tally = 3")
            names = reply_to(kc, kc.complete("x = my_ta"))["content"]
            code = "print(1)\nmy_table.move_to\nprint(2)"
            attrs = reply_to(kc, kc.complete(code, code.index("\nprint(2)")))["content"]
            found = reply_to(kc, kc.inspect("my_table", 3))["content"]
            missing = reply_to(kc, kc.inspect("not_defined_anywhere"))["content"]
            seen = {
                "names": sorted(m for m in names["matches"] if m.startswith("my_")),
                "names_at": [names["cursor_start"], names["cursor_end"]],
                "attrs": attrs["matches"],
                "attrs_start": attrs["cursor_start"] == code.index("move_to"),
                "found": [found["status"], found["found"], "OrderedDict" in found["data"].get("text/plain", "")],
                "missing": [missing["status"], missing["found"]],
            }
            print(json.dumps(seen))
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)  # a shutdown_request: the kernel stops its cluster
        return
    try:
        info = reply_to(kc, kc.kernel_info())["content"]
        seen["language"] = info["language_info"]["name"]
        seen["protocol_version"] = info["protocol_version"]

        run(kc, "x = 41")
        reply, outs = run(kc, "print(x + 1)\nx * 2")
        seen["print"] = text(outs)
        seen["execute_result_count"] = [c.get("execution_count") for k, c in outs if k == "execute_result"]
        seen["reply_count"] = reply["execution_count"]
        seen["execute_input"] = [c["code"] for k, c in outs if k == "execute_input"]

        # a cell of whitespace alone: IPython runs and counts nothing, so the next
        # cell's number is the one its output is kept under (`Out[N]`)
        empty, _ = run(kc, "  \n")
        reply, outs = run(kc, "x")
        shown = [c.get("execution_count") for k, c in outs if k == "execute_result"]
        _, kept = run(kc, "print(sorted(Out))")
        seen["empty_cell"] = [empty["status"], empty["execution_count"], reply["execution_count"], shown, text(kept)]

        # user_expressions: evaluated after the cell in its namespace; `x` is not in
        # this cell's closure (it is brought in), `nope` is nowhere
        asked = {"double": "y * 2", "prev": "x + 1", "missing": "nope"}
        reply, _ = run(kc, "y = 5", user_expressions=asked)
        got = reply["user_expressions"]
        seen["user_expressions"] = {
            k: v["data"]["text/plain"] if v["status"] == "ok" else v["ename"] for k, v in got.items()
        }

        reply, outs = run(kc, "1/0")
        seen["error"] = [reply["status"], reply.get("ename")]
        seen["error_output"] = [c["ename"] for k, c in outs if k == "error"]

        reply, outs = run(kc, "from IPython.display import clear_output\nprint('a')\nclear_output()\nprint('b')")
        seen["clear_output"] = [k for k, _ in outs if k in ("stream", "clear_output")]

        seen["is_complete"] = reply_to(kc, kc.is_complete("for i in range(3):"))["content"]["status"]

        # input() and getpass() ask on the stdin channel, as with ipykernel
        code = "print('asking')\nname = input('name? ')\nimport getpass\npw = getpass.getpass('pw: ')\n"
        code += "print(name, len(pw))"
        msg_id = kc.execute(code, allow_stdin=True)
        asked = []
        for answer in ("Ada", "secret"):
            req = kc.get_stdin_msg(timeout=TIMEOUT)
            content, parent = req["content"], req["parent_header"]["msg_id"]
            asked.append([content["prompt"], content["password"], parent == msg_id])
            kc.input(answer)
        reply, outs = finish(kc, msg_id)
        seen["stdin_asked"] = asked
        seen["stdin_answered"] = [reply["status"], text(outs)]
        # a client without a stdin channel: StdinNotImplementedError, as from ipykernel
        reply, outs = run(kc, "input('name? ')", allow_stdin=False)
        seen["no_stdin"] = [reply["status"], reply.get("ename"), reply.get("evalue")]
        # an interrupt while the cell waits for input: KeyboardInterrupt, state kept
        msg_id = kc.execute("z = 5\ninput('waiting? ')\nz = 6", allow_stdin=True)
        kc.get_stdin_msg(timeout=TIMEOUT)
        km.interrupt_kernel()
        reply, outs = finish(kc, msg_id)
        seen["stdin_interrupted"] = [reply["status"], reply.get("ename")]
        seen["after_stdin_interrupt"] = text(run(kc, "print(z)")[1])

        # interrupt a cell that loops: KeyboardInterrupt, and the state stays
        msg_id = kc.execute("import time\ny = 1\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.05)")
        wait_for_output(kc, msg_id)
        km.interrupt_kernel()
        reply, outs = finish(kc, msg_id)
        seen["interrupted"] = [reply["status"], reply.get("ename")]
        seen["interrupted_outputs"] = outs
        reply, outs = run(kc, "print(x, y)")
        seen["after_interrupt"] = text(outs) or [reply, outs]

        # SIGINT to the kernel process interrupts the cell too, as with ipykernel
        msg_id = kc.execute("print('looping', flush=True)\nwhile True:\n    time.sleep(0.05)")
        wait_for_output(kc, msg_id)
        km.signal_kernel(signal.SIGINT)
        reply = reply_to(kc, msg_id)["content"]
        seen["sigint"] = [reply["status"], reply.get("ename")]
        seen["sigint_evalue"] = reply.get("evalue")

        # a restart is a fresh session
        km.restart_kernel()
        kc.wait_for_ready(timeout=TIMEOUT)
        reply, outs = run(kc, "print(x)")
        seen["after_restart"] = [reply["status"], reply.get("ename")]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
