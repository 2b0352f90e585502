"""Completion and inspection without live objects (src/kernel/codehelp.rs).

When the session has no CPU worker to ask (no CPU cell ran yet, or every cell
is serverless), the kernel asks this helper, which reads the session's code as
an editor does: jedi infers from the cells the kernel ran (IPython syntax
turned into Python first) followed by the cell being edited. One JSON request
per line on stdin, one JSON reply content per line on stdout.
"""

import json
import os
import sys

import jedi
from IPython.core.inputtransformer2 import TransformerManager

_transform = TransformerManager().transform_cell


def _python(cell):
    try:
        return _transform(cell)
    except Exception:  # noqa: BLE001 - a cell IPython cannot read: left out
        return ""


def _script(req):
    """The script of the session's cells, then the edited code; the cursor's
    (line, column) in it."""
    before = "".join(_python(c).rstrip("\n") + "\n" for c in req["history"])
    code, pos = req["code"], max(0, min(req["cursor_pos"], len(req["code"])))
    head = code[:pos]
    line = before.count("\n") + head.count("\n") + 1
    column = len(head) - (head.rfind("\n") + 1)
    path = os.path.join(os.getcwd(), "notebook.py")  # the notebook's folder: its modules resolve
    return jedi.Script(before + code, path=path), line, column, pos


def complete(req):
    script, line, column, pos = _script(req)
    found = script.complete(line, column)
    matches, start = [], pos
    for c in found:
        typed = len(c.name) - len(c.complete)
        start = pos - typed
        matches.append(c.name)
    return {"status": "ok", "matches": matches, "cursor_start": start, "cursor_end": pos, "metadata": {}}


def inspect(req):
    script, line, column, _ = _script(req)
    names = script.infer(line, column) or script.help(line, column)
    for n in names:
        doc = n.docstring(raw=True)
        sigs = [s.to_string() for s in n.get_signatures()]
        if not doc and not sigs:
            continue
        text = []
        if sigs:
            text.append(f"Signature: {sigs[0]}")
        if doc:
            text.append(f"Docstring:\n{doc}")
        # as IPython: an instance's type is its class
        text.append(f"Type:      {n.name if n.type == 'instance' else n.type}")
        return {"status": "ok", "found": True, "data": {"text/plain": "\n".join(text)}, "metadata": {}}
    return {"status": "ok", "found": False, "data": {}, "metadata": {}}


def main():
    for raw in sys.stdin:
        try:
            req = json.loads(raw)
            content = complete(req) if req["kind"] == "complete" else inspect(req)
        except Exception as e:  # noqa: BLE001 - a bad request or a jedi failure: nothing found
            content = {"status": "error", "ename": type(e).__name__, "evalue": str(e), "traceback": []}
        sys.stdout.write(json.dumps(content) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
