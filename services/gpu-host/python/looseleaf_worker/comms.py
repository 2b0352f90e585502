"""Comms in a worker, so that ipywidgets work (ADR 33).

As in ipykernel, the ``comm`` package's ``create_comm`` makes this runtime's
comms. A comm's messages to the client are outputs of the worker
(``{"output_type": "comm", "msg_type", "content", "metadata", "buffers"}``):
during a cell they stream with its other outputs, in order; between cells the
host passes the client's comm messages to the session's CPU worker (a ``comm``
frame) and what handling one caused comes back in the answer.

A widget outlives the worker that made it by its state: it is pickled as its
class, model id and synced traits, and rebuilt on its old model id without a
new ``comm_open`` (the client still holds the model), so a later cell reads it
and the CPU worker that restores it serves the client's changes from then on.
"""

from __future__ import annotations

import base64
import logging
import sys
from typing import Any

from . import quiet

try:
    import comm
    from comm.base_comm import BaseComm
except ImportError:  # an environment without it has no widgets either
    comm = None
    BaseComm = object

# Where a comm's messages go: the worker's output sink (set by ``install``).
_emit = None


class WorkerComm(BaseComm):
    """A comm whose messages to the client are worker outputs."""

    def publish_msg(self, msg_type: str, data=None, metadata=None, buffers=None, **keys) -> None:
        if _emit is None:
            return  # a zygote, before any worker: no client to tell
        content = {"data": {} if data is None else data, "comm_id": self.comm_id, **keys}
        _emit(
            {
                "output_type": "comm",
                "msg_type": msg_type,
                "content": content,
                "metadata": metadata or {},
                "buffers": [base64.b64encode(bytes(b)).decode("ascii") for b in buffers or []],
            }
        )


class _WorkerLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        quiet.log(f"looseleaf worker: comm: {record.getMessage()}")


def _create_comm(*args, **kwargs) -> BaseComm:
    return WorkerComm(*args, **kwargs)


def install(emit) -> None:
    """Make this runtime's comms; their messages go to ``emit``. ipywidgets
    registers its comm targets at import only inside an IPython shell, and a
    zygote imports it before the shell exists: register them here then."""
    global _emit
    _emit = emit
    if comm is None:
        return
    # The comm manager logs what it could not do (a target it lacks, a message to
    # a closed comm); ipykernel's goes to the kernel's log, never a notebook.
    log = logging.getLogger("Comm")
    if not any(isinstance(h, _WorkerLog) for h in log.handlers):
        log.addHandler(_WorkerLog())
    log.propagate = False
    comm.create_comm = _create_comm
    widgets = sys.modules.get("ipywidgets")
    if widgets is not None and hasattr(widgets, "register_comm_target"):
        widgets.register_comm_target()


def handle(msg_type: str, content: dict, metadata: dict, buffers: list[str]) -> dict:
    """A client's comm message, as ipykernel's shell handlers take it; returns
    the reply's content for a ``comm_info_request`` (else an empty dict)."""
    if msg_type not in ("comm_open", "comm_msg", "comm_close", "comm_info_request"):
        return {"status": "error", "ename": "ValueError", "evalue": f"{msg_type!r} is not a comm message"}
    if comm is None:
        if msg_type == "comm_open" and _emit is not None:  # no target here: closed, as ipykernel does
            _emit(
                {
                    "output_type": "comm",
                    "msg_type": "comm_close",
                    "content": {"comm_id": content.get("comm_id", ""), "data": {}},
                    "metadata": {},
                    "buffers": [],
                }
            )
        return {"status": "ok", "comms": {}} if msg_type == "comm_info_request" else {}
    manager = comm.get_comm_manager()
    if msg_type == "comm_info_request":
        target = content.get("target_name")
        comms = {
            cid: {"target_name": c.target_name}
            for cid, c in list(manager.comms.items())
            if target is None or c.target_name == target
        }
        return {"status": "ok", "comms": comms}
    msg = {
        "header": {"msg_type": msg_type},
        "content": content,
        "metadata": metadata,
        "buffers": [base64.b64decode(b) for b in buffers],
    }
    handlers = {"comm_open": manager.comm_open, "comm_msg": manager.comm_msg, "comm_close": manager.comm_close}
    handlers[msg_type](None, None, msg)
    return {}


def is_widget(obj: Any) -> bool:
    widgets = sys.modules.get("ipywidgets")
    return widgets is not None and isinstance(obj, widgets.Widget)


def reduce_widget(w: Any) -> tuple:
    """A widget as its class, model id and the synced traits a constructor takes
    (trait values that are widgets pickle the same way)."""
    traits = w.traits()
    state = {
        k: getattr(w, k) for k in w.keys if k in traits and not traits[k].read_only and not k.startswith("_view_count")
    }
    model_id = w.comm.comm_id if w.comm is not None else None
    return (rebuild_widget, (type(w), model_id, state))


def rebuild_widget(cls: type, model_id: str | None, state: dict) -> Any:
    """A widget on its old model id: its comm is set before ``__init__``, so the
    widget does not open a new one (the client holds the model already)."""
    if model_id is None:
        return cls(**state)  # it had been closed: a new model
    w = cls.__new__(cls)
    c = WorkerComm(comm_id=model_id, primary=False, target_name="jupyter.widget")
    comm.get_comm_manager().register_comm(c)
    w.comm = c
    cls.__init__(w, **state)
    return w
