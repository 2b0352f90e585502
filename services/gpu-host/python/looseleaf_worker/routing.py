"""Which request a cell message (a notebook output, a comm message, pager text,
user_expressions results) belongs to, as in ipykernel: a cell's, or a client's
comm message's; a thread's is that of the request it was started in. Output of
no request being served goes to the host's log, and comm messages made
meanwhile wait for the next request."""

from __future__ import annotations

import contextlib
import threading

from . import comms, quiet

# Comm messages kept for the next request while none is served (a thread that
# updates a widget between cells); beyond this, the oldest are dropped.
PENDING_COMMS_MAX = 10_000


def _track_thread_parents(parent_of_current) -> None:
    """As ipykernel does: a thread belongs to the request (cell or comm message)
    that was served where it was started, and a thread it starts belongs there
    too; what it outputs is that request's (see ``Worker._emit_message``)."""
    start = threading.Thread.start
    if getattr(start, "_looseleaf", False):
        return

    def tracked_start(thread, *args, **kwargs):
        thread._looseleaf_parent = parent_of_current()
        return start(thread, *args, **kwargs)

    tracked_start._looseleaf = True
    threading.Thread.start = tracked_start


class OutputRouting:
    """The worker's output routing, a base of ``Worker``, which provides
    ``shell``, ``interrupts``, ``exec_id`` and ``send``."""

    def _setup_routing(self) -> None:
        # The request being served, the parent of what is output: a cell's exec
        # id, or a token for a client's comm message; None between them. Threads
        # send outputs too: frames go out one at a time (``_send_lock``), and an
        # exchange with the host (a send and its answer) is not interleaved with
        # another thread's (``_exchange``).
        self._parent: str | None = None
        self._send_lock = threading.RLock()
        self._exchange = threading.Lock()
        self._stray_text: dict[str, str] = {}  # a thread's text with no request to go to
        self._pending_comms: list[dict] = []  # comm messages made between requests
        _track_thread_parents(self._thread_parent)
        for stream in self.shell._streams.values():
            self._share_stream(stream)
        # comm messages to the client (ipywidgets) are cell messages (ADR 33)
        self._collected: list[dict] | None = None  # cell messages for a comm answer
        comms.install(self._emit_message, self._thread_parent)

    def _thread_parent(self) -> str | None:
        """The request the calling thread's output belongs to."""
        if threading.current_thread() is threading.main_thread():
            return self._parent
        return getattr(threading.current_thread(), "_looseleaf_parent", None)

    def _share_stream(self, stream) -> None:
        """Make one of the shell's streams (sys.stdout, sys.stderr) safe for
        threads: its buffer is changed by one thread at a time, and the text of
        a thread whose request is no longer served does not join the running
        cell's (as ipykernel buffers each parent's text apart): it is logged."""
        if getattr(stream, "_looseleaf_shared", False):
            return
        write, flush, flush_lines, name = stream.write, stream.flush, stream.flush_lines, stream.name

        def locked(fn):
            def call(*args):
                with self._send_lock:
                    return fn(*args)

            return call

        def routed_write(s):
            if threading.current_thread() is threading.main_thread() or self._thread_parent() == self._parent:
                with self._send_lock:
                    return write(s)
            if not isinstance(s, str):
                raise TypeError(f"write() argument must be str, not {type(s).__name__}")
            with self._send_lock:
                text = self._stray_text.get(name, "") + s
                cut = text.rfind("\n") + 1
                self._stray_text[name] = text[cut:]
            if cut:
                quiet.log(f"looseleaf worker: a thread's {name} after its cell: {text[:cut]}")
            return len(s)

        stream.write, stream.flush, stream.flush_lines = routed_write, locked(flush), locked(flush_lines)
        stream._looseleaf_shared = True

    def _emit_message(self, message: dict) -> None:
        """Send one CellMessage as its request's: a cell's, streamed; a comm
        message's, collected for its answer. As in ipykernel, a thread's message
        is that of the request it was started in: when that one has ended, it is
        no cell's (nbclient records none of it; the log has it). A comm message
        goes to the client whatever its thread, with the request being served or
        the next one."""
        token = self._thread_parent()
        main = threading.current_thread() is threading.main_thread()
        # the main thread's frame is not cut by an interrupt; another thread's
        # is never interrupted (signals go to the main thread)
        with self.interrupts.shield() if main else contextlib.nullcontext(), self._send_lock:
            if "output" in message and comms.capture(token, message["output"]):
                return  # an Output widget's, which syncs it to the client itself
            if is_comm(message) and self._parent is not None:
                token = self._parent
            if token is None or token != self._parent:
                self._stray(message)
            elif self._collected is not None:
                self._collected.append(message)  # they answer the client's comm message
            else:
                self.send({"type": "cell_message", "exec_id": self.exec_id, "message": message})

    def _stray(self, message: dict) -> None:
        """A message while no request of its own is served: a comm message waits
        for the next request (the client's model must follow the widget); any
        other (output of a __setstate__ that prints at restore, of a thread after
        its cell) goes to the host's log, never a cell's output."""
        if not is_comm(message):
            output = message.get("output")
            shown = (output.get("text") or output) if output is not None else message
            quiet.log(f"looseleaf worker: output outside its cell: {shown}")
            return
        last = self._pending_comms[-1] if self._pending_comms else None
        if last is not None and _same_comm_update(last["comm"], message["comm"]):
            # a widget updated again (a progress bar): one update with the latest state
            last["comm"]["content"]["data"]["state"].update(message["comm"]["content"]["data"]["state"])
            return
        self._pending_comms.append(message)
        if len(self._pending_comms) > PENDING_COMMS_MAX:
            dropped = self._pending_comms.pop(0)
            quiet.log(f"looseleaf worker: a comm message made between cells was dropped: {dropped['comm']['msg_type']}")

    def _begin(self, token: str, collect: bool) -> None:
        """Start serving a request: its messages are collected for an answer
        (``collect``) or streamed; comm messages made meanwhile go first."""
        with self._send_lock:
            self._parent = token
            pending, self._pending_comms = self._pending_comms, []
            if collect:
                self._collected = pending
                return
            for message in pending:
                self.send({"type": "cell_message", "exec_id": token, "message": message})

    def _end(self) -> list[dict] | None:
        """Stop serving the request: no thread's message or exchange goes out as
        its any more. Returns the messages collected for an answer."""
        with self._exchange, self._send_lock:
            self._parent = self.exec_id = None
            collected, self._collected = self._collected, None
        return collected


def is_comm(message: dict) -> bool:
    """Whether a CellMessage is a comm message to the client (not a notebook
    output, pager text or user_expressions results)."""
    return "comm" in message


def _same_comm_update(a: dict, b: dict) -> bool:
    """Whether comm message ``b`` only updates the same widget's state as ``a`` does
    (the bodies of two ``comm`` CellMessages)."""

    def update(o):
        data = o["content"].get("data") or {}
        plain = o["msg_type"] == "comm_msg" and data.get("method") == "update" and not o["buffers"]
        return plain and not data.get("buffer_paths") and isinstance(data.get("state"), dict)

    return update(a) and update(b) and a["content"].get("comm_id") == b["content"].get("comm_id")
