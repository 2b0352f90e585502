"""Comms in a worker, so that ipywidgets work (ADR 33).

As in ipykernel, the ``comm`` package's ``create_comm`` makes this runtime's
comms. A comm's messages to the client are cell messages of the worker, of
kind ``comm`` (``{"comm": {"msg_type", "content", "metadata", "buffers"}}``):
during a cell they stream with its outputs, in order; between cells the
host passes the client's comm messages to the session's CPU worker (a ``comm``
frame) and what handling one caused comes back in the answer.

A widget outlives the worker that made it by its state: it is pickled as its
class, model id and traits, and rebuilt on its old model id without a new
``comm_open`` (the client still holds the model), so a later cell reads it and
the CPU worker that restores it serves the client's changes from then on. A
widget its traits do not make (``interactive``, one with callbacks, a class
with its own constructor) cannot be pickled: it stays live in its worker.

Output produced inside an ``Output`` widget's context goes to that widget, as
a frontend puts it there for ipykernel (see ``capture``).
"""

from __future__ import annotations

import base64
import logging
import pickle
import sys
from typing import Any

from . import quiet

try:
    import comm
    from comm.base_comm import BaseComm
except ImportError:  # an environment without it has no widgets either
    comm = None
    BaseComm = object

# Where a comm's messages go: the worker's CellMessage sink (set by ``install``).
_emit = None


class WorkerComm(BaseComm):
    """A comm whose messages to the client are the worker's ``comm`` cell messages."""

    # ipywidgets sends nothing on a comm whose ``kernel`` is None, and an Output
    # widget asks it for the parent request (see ``_Kernel``)
    @property
    def kernel(self):
        return None if self.__dict__.get("_quiet") else _KERNEL

    def publish_msg(self, msg_type: str, data=None, metadata=None, buffers=None, **keys) -> None:
        if _emit is None:
            return  # a zygote, before any worker: no client to tell
        if msg_type == "comm_msg":
            _note_msg_id(self.comm_id, data)
        content = {"data": {} if data is None else data, "comm_id": self.comm_id, **keys}
        _emit(
            {
                "comm": {
                    "msg_type": msg_type,
                    "content": content,
                    "metadata": metadata or {},
                    "buffers": [base64.b64encode(bytes(b)).decode("ascii") for b in buffers or []],
                }
            }
        )


class _WorkerLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        quiet.log(f"looseleaf worker: comm: {record.getMessage()}")


def _create_comm(*args, **kwargs) -> BaseComm:
    return WorkerComm(*args, **kwargs)


def install(emit, parent=None) -> None:
    """Make this runtime's comms; their messages go to ``emit`` (as ``comm``
    CellMessages, ``{"comm": {...}}``); ``parent()`` is
    the parent token of the calling thread (what an Output widget captures).
    ipywidgets registers its comm targets at import only inside an IPython shell,
    and a zygote imports it before the shell exists: register them here then."""
    global _emit, _parent
    _emit, _parent = emit, parent
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
                    "comm": {
                        "msg_type": "comm_close",
                        "content": {"comm_id": content.get("comm_id", ""), "data": {}},
                        "metadata": {},
                        "buffers": [],
                    }
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


# ------------------------------------------------------------ Output widgets
#
# In ipykernel, ``with out:`` sets the Output widget's ``msg_id`` to the running
# request's id, and the frontend (JupyterLab, or nbclient mimicking it) puts the
# outputs that have that parent into the widget's ``outputs`` instead of the
# cell's. A worker's outputs reach no frontend directly, so the worker does the
# frontend's part itself, as nbclient's OutputWidget does: it watches the
# ``msg_id`` updates the widget sends, and while one is set to the current parent,
# that parent's outputs are appended to the widget's ``outputs`` (which syncs them
# to the client) and are not the cell's.


class _Kernel:
    """What ipywidgets asks of a comm's kernel: the parent request, whose id an
    Output widget takes as its ``msg_id`` (a cell's exec id, or a comm message's)."""

    def get_parent(self) -> dict:
        token = _parent() if _parent is not None else None
        return {"header": {"msg_id": token}} if token else {}


_KERNEL = _Kernel()
_parent = None  # () -> the parent token of the calling thread (set by ``install``)
_hooks: dict[str, list[str]] = {}  # msg_id -> comm ids of Output widgets capturing it
_clear_before_next: set[str] = set()  # Output widgets with a clear_output(wait=True) pending


def _note_msg_id(comm_id: str, data: Any) -> None:
    """An Output widget tells the client its ``msg_id``: start or stop capturing
    (as nbclient's OutputWidget registers and removes its output hook)."""
    if not isinstance(data, dict) or data.get("method") != "update":
        return
    state = data.get("state") or {}
    if "msg_id" not in state:
        return
    for stack in _hooks.values():
        if comm_id in stack:
            stack.remove(comm_id)
    if state["msg_id"]:
        _hooks.setdefault(state["msg_id"], []).append(comm_id)
    for k in [k for k, v in _hooks.items() if not v]:
        del _hooks[k]


def capture(token: str | None, output: dict) -> bool:
    """Put the notebook output ``output`` (of parent ``token``) into the Output
    widget capturing that parent, if any, as a frontend would; True if it was taken."""
    if token is None or not _hooks.get(token):
        return False
    kind = output.get("output_type")
    if kind not in ("stream", "display_data", "execute_result", "error", "clear_output"):
        return False
    instances = getattr(sys.modules.get("ipywidgets.widgets.widget"), "_instances", {})
    comm_id = _hooks[token][-1]
    widget = instances.get(comm_id)
    if widget is None:
        return False  # closed meanwhile: the output is the cell's
    outputs = list(widget.outputs)
    if kind == "clear_output":
        if output.get("wait"):
            _clear_before_next.add(comm_id)
            return True
        outputs = []
    else:
        if comm_id in _clear_before_next:
            _clear_before_next.discard(comm_id)
            outputs = []
        out = {k: v for k, v in output.items() if k != "transient"}
        last = outputs[-1] if outputs else None
        if kind == "stream" and last and last.get("output_type") == "stream" and last.get("name") == out["name"]:
            outputs[-1] = dict(last, text=last["text"] + out["text"])  # merged, as nbclient does
        else:
            outputs.append(out)
    widget.outputs = tuple(outputs)  # synced to the client, as the frontend syncs it back
    return True


# ------------------------------------------------------------ saving widgets
#
# A widget is pickled as its class, model id and traits and rebuilt by calling its
# class's ``__init__`` with those traits (on its old comm). That is only faithful
# when the traits are all there is to it; otherwise pickling raises, which makes
# the variable unsavable: it stays live in the worker that made it (DESIGN.md §6),
# rather than being saved in a form that fails, or differs, when restored.

# Traits that are no constructor argument: the comm (the model id stands for
# it), the sync machinery's bookkeeping, and the number of views.
_NOT_STATE = {"comm", "keys", "log", "_property_lock", "_states_to_send", "_msg_callbacks", "_view_count"}

# Instance attributes (not traits) that ipywidgets' own ``__init__`` makes from
# the traits it is given; any other attribute is state the traits do not carry.
_REBUILT_ATTRS = {
    "_trait_values",
    "_trait_notifiers",
    "_trait_validators",
    "_cross_validation_lock",
    "_model_id",
    "_property_rewrite",  # the layout templates' LayoutProperties
    "_click_handlers",  # Button (its callbacks are checked below)
    "_submission_callbacks",  # Text, Password, Combobox (the same)
    "_step_metadata",  # the date and time pickers
    "equals",  # the selections: their comparison, a lambda of ipywidgets'
    "_initializing_traits_",
    "_options_full",
    "_options_values",
    "_Output__counter",  # how deep ``with out:`` is nested: 0 outside
}

_OWN_MODULES = ("ipywidgets.", "traitlets.")


def is_widget(obj: Any) -> bool:
    widgets = sys.modules.get("ipywidgets")
    return widgets is not None and isinstance(obj, widgets.Widget)


def _own_callback(w: Any, fn: Any) -> bool:
    """Whether ``fn`` is one that ``__init__`` registers again on the rebuilt
    widget: a handler its class declares (``@observe``), or a method of the
    widget itself from ipywidgets (a Button's message handler)."""
    import traitlets

    if isinstance(fn, traitlets.EventHandler):
        return True
    func = getattr(fn, "__func__", None)
    return getattr(fn, "__self__", None) is w and (getattr(func, "__module__", None) or "").startswith(_OWN_MODULES)


def _why_not_rebuilt(w: Any) -> str | None:
    """Why ``w`` cannot be rebuilt from its traits, or None if it can."""
    import inspect

    from ipywidgets import CallbackDispatcher

    cls = type(w)
    for klass in cls.__mro__:
        own = (klass.__module__ or "") + "."
        if "__init__" in vars(klass) and not own.startswith(_OWN_MODULES) and klass is not object:
            # a class of the notebook's (or of another library) with its own
            # constructor: nothing says it takes its traits as keywords
            return f"its class {klass.__qualname__} has its own __init__"
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        params = []
    needs = [
        p.name
        for p in list(params)[1:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in w.traits()
    ]
    if needs:  # interactive(f, ...): the function is no trait
        return f"{cls.__name__}.__init__ needs {', '.join(needs)}, which no trait gives"
    extra = sorted(k for k in vars(w) if k not in _REBUILT_ATTRS and not w.has_trait(k))
    if extra:  # GridspecLayout's cell map, or an attribute a cell set
        return f"it holds state that is not a trait ({', '.join(extra)})"
    for name, by_type in w._trait_notifiers.items():
        for handlers in by_type.values():
            if any(not _own_callback(w, h) for h in handlers):
                return f"a callback observes its {name!r}"
    for name, h in w._trait_validators.items():
        if not _own_callback(w, h):
            return f"a callback validates its {name!r}"
    for value in [*vars(w).values(), *w._trait_values.values()]:
        if isinstance(value, CallbackDispatcher) and any(not _own_callback(w, cb) for cb in value.callbacks):
            return "it holds callbacks (on_click, on_msg, on_submit or the like)"
    return None


def reduce_widget(w: Any) -> tuple:
    """A widget as its class, model id and the traits its constructor takes
    (trait values that are widgets pickle the same way); raises if those would
    not rebuild it."""
    why = _why_not_rebuilt(w)
    if why is not None:
        raise pickle.PicklingError(f"the {type(w).__name__} widget cannot be rebuilt from its traits: {why}")
    model_id = w.comm.comm_id if w.comm is not None else None
    return (rebuild_widget, (type(w), model_id, widget_state(w)))


def widget_state(w: Any) -> dict:
    """The traits a widget is rebuilt from, as its constructor's keywords, in an
    order its validators accept: all it holds of its own (the rest, such as its
    class's handlers and its logger, the rebuild makes anew)."""
    traits = w.traits()
    state = {k: getattr(w, k) for k, t in traits.items() if k not in _NOT_STATE and not t.read_only}
    sel = sys.modules["ipywidgets.widgets.widget_selection"]
    if isinstance(w, (sel._Selection, sel._MultipleSelection)):
        # the options, then the index: value and label follow from them (set too,
        # they would be checked against options not yet set, and a value shared by
        # two options would move the index to the first)
        state = {"options": state.pop("options"), "index": state.pop("index"), **state}
        state.pop("value", None)
        state.pop("label", None)
    return state


def rebuild_widget(cls: type, model_id: str | None, state: dict) -> Any:
    """A widget on its old model id: its comm is set before ``__init__``, so the
    widget does not open a new one (the client holds the model already)."""
    if model_id is None:
        return cls(**state)  # it had been closed: a new model
    w = cls.__new__(cls)
    c = WorkerComm(comm_id=model_id, primary=False, target_name="jupyter.widget")
    comm.get_comm_manager().register_comm(c)
    # the client holds this state already: nothing is sent while it is set
    c._quiet = True
    w.comm = c
    try:
        cls.__init__(w, **state)
    finally:
        c._quiet = False
    return w
