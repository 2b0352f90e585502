"""An IPython shell whose outputs equal a Jupyter kernel's.

InteractiveShell is made to behave like ipykernel's ZMQInteractiveShell: rich
displays and execute results go out as nbformat outputs, stdout/stderr become
stream outputs, tracebacks become error outputs. Only the transport differs:
``emit(output_dict)`` is called for every output, and the worker frames it.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Callable

# ipykernel sets this before the shell exists so that pyplot picks the inline
# backend, which registers its flush-at-cell-end hook on the live shell.
os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"

from IPython.core.displayhook import DisplayHook  # noqa: E402
from IPython.core.displaypub import DisplayPublisher  # noqa: E402
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from . import placement  # noqa: E402

Emit = Callable[[dict], None]


class OutputStream(io.TextIOBase):
    """sys.stdout/sys.stderr replacement that delivers text as ipykernel does.

    ipykernel buffers each stream on its own and flushes it 0.2 s after its first
    buffered write (a timer in its IO thread), and both streams, stdout first,
    before a display, an error and at cell end. So a quick ``print``, warning,
    ``print`` arrives as all of stdout, then stderr. A worker has no IO thread:
    every write first flushes the streams whose time is up, oldest first, which
    gives the same order. A timed flush sends whole lines only."""

    FLUSH_CHARS = 8192
    FLUSH_SECONDS = 0.2

    def __init__(self, name: str, shell: WorkerShell):
        self.name = name
        self._shell = shell
        self._buf: list[str] = []
        self._size = 0
        self.due = 0.0  # when the oldest buffered text must go

    @property
    def encoding(self):  # libraries (pexpect, tqdm) ask for it
        return "utf-8"

    def writable(self):
        return True

    def isatty(self):
        return False

    def fileno(self):
        # Some libraries want a real fd (faulthandler, subprocess); give the
        # process's own. Output written there is not captured, as in ipykernel
        # without its fd capture.
        return 1 if self.name == "stdout" else 2

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if not s:
            return 0
        self._shell.flush_due()
        if not self._buf:
            self.due = time.monotonic() + self.FLUSH_SECONDS
        self._buf.append(s)
        self._size += len(s)
        if self._size >= self.FLUSH_CHARS:
            self.flush_lines()
        return len(s)

    def pending(self) -> bool:
        return bool(self._buf)

    def flush_lines(self):
        """Flush whole lines only, so a print's text and its newline (two writes)
        never land in two outputs; a long line without a newline goes anyway."""
        text = "".join(self._buf)
        cut = text.rfind("\n") + 1
        if cut == 0 and len(text) < self.FLUSH_CHARS:
            return
        if cut == 0:
            cut = len(text)
        head, rest = text[:cut], text[cut:]
        self._buf = [rest] if rest else []
        self._size = len(rest)
        self.due = time.monotonic() + self.FLUSH_SECONDS
        self._shell.emit({"output_type": "stream", "name": self.name, "text": head})

    def flush(self):
        if not self._buf:
            return
        text = "".join(self._buf)
        self._buf, self._size = [], 0
        self._shell.emit({"output_type": "stream", "name": self.name, "text": text})


class WorkerDisplayPublisher(DisplayPublisher):
    """Like ipykernel's ZMQDisplayPublisher: display() -> display_data output."""

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kw):
        self.shell.flush_streams()
        out = {
            "output_type": "update_display_data" if update else "display_data",
            "data": jsonable(data),
            "metadata": jsonable(metadata or {}),
        }
        if transient:
            # display_id lives here, as in Jupyter's message; a notebook writer
            # uses it to find the outputs an update replaces, then drops it
            out["transient"] = jsonable(transient)
        self.shell.emit(out)

    def clear_output(self, wait=False):
        # Jupyter's clear_output message, for the notebook writer to apply
        self.shell.flush_streams()
        self.shell.emit({"output_type": "clear_output", "wait": bool(wait)})


class WorkerDisplayHook(DisplayHook):
    """Like ipykernel's ZMQShellDisplayHook: the last expression's value becomes an
    execute_result with the cell's execution_count."""

    def start_displayhook(self):
        self._msg = {
            "output_type": "execute_result",
            "data": {},
            "metadata": {},
            "execution_count": self.shell.execution_count,
        }

    def write_output_prompt(self):
        self._msg["execution_count"] = self.prompt_count

    def write_format_data(self, format_dict, md_dict=None):
        self._msg["data"] = jsonable(format_dict)
        self._msg["metadata"] = jsonable(md_dict or {})

    def finish_displayhook(self):
        self.shell.flush_streams()
        if self._msg["data"]:
            self.shell.emit(self._msg)
        self._msg = None


def jsonable(d: dict) -> dict:
    # Mime bundles may carry bytes (image/png before base64 in old formatters).
    import base64

    out = {}
    for k, v in d.items():
        if isinstance(v, bytes):
            v = base64.b64encode(v).decode("ascii")
        elif isinstance(v, dict):
            v = jsonable(v)
        out[k] = v
    return out


class WorkerShell(InteractiveShell):
    """The cell runtime. ``emit`` receives each nbformat output dict."""

    display_pub_class = WorkerDisplayPublisher
    displayhook_class = WorkerDisplayHook

    def __init__(self, emit: Emit, **kw):
        self._emit = emit
        self._streams: dict[str, OutputStream] = {}
        self.last_error: dict | None = None
        super().__init__(**kw)
        # `%%gpu [N]` / `%%cpu` lines were read by the planner: the body runs
        placement.load_ipython_extension(self)
        self._streams = {"stdout": OutputStream("stdout", self), "stderr": OutputStream("stderr", self)}
        sys.stdout = self._streams["stdout"]
        sys.stderr = self._streams["stderr"]
        # The display formatters are built on first use (~0.5 ms, ~1.7 ms in a
        # forked worker); built here, in the zygote, every worker has them.
        _ = self.display_formatter.formatters

    def init_history(self):
        # History lives in memory: ambient state carries it between workers,
        # and a sqlite file per worker would only cost time.
        self.config.HistoryManager.hist_file = ":memory:"
        super().init_history()

    def bind(self, emit: Emit) -> None:
        """Send outputs to ``emit`` from now on (a zygote makes the shell before it
        forks; each worker binds it to its own socket)."""
        self._emit = emit

    def emit(self, output: dict) -> None:
        self._emit(output)

    def flush_streams(self):
        for s in self._streams.values():  # stdout first, as ipykernel
            s.flush()

    def flush_due(self):
        """Flush the streams whose buffered text is older than their interval,
        oldest first (what ipykernel's IO thread would have sent by now)."""
        now = time.monotonic()
        due = [s for s in self._streams.values() if s.pending() and s.due <= now]
        for s in sorted(due, key=lambda s: s.due):
            s.flush_lines()

    def init_hooks(self):
        super().init_hooks()
        # As ipykernel: `obj?` and friends page their text; a notebook shows
        # nothing for it, Jupyter clients show it in a pager (a payload).
        self.set_hook("show_in_pager", self._page, 99)

    def _page(self, shell, strg, start=0, screen_lines=0, pager_cmd=None):
        data = strg if isinstance(strg, dict) else {"text/plain": strg}
        self.flush_streams()
        self.emit({"output_type": "pager", "data": jsonable(data), "start": max(0, start)})

    def _get_exc_info(self, exc_tuple=None):
        etype, value, tb = super()._get_exc_info(exc_tuple)
        if etype is not None and issubclass(etype, KeyboardInterrupt):
            _drop_interrupt_frame(tb)
        return etype, value, tb

    def _showtraceback(self, etype, evalue, stb):
        # ipykernel publishes an 'error' output instead of printing.
        self.flush_streams()
        err = {"ename": str(etype.__name__), "evalue": str(evalue), "traceback": [str(x) for x in stb]}
        self.last_error = err
        self.emit({"output_type": "error", **err})

    def enable_gui(self, gui=None):
        # `%matplotlib inline` asks for no GUI loop; a worker has no other.
        if gui not in (None, "inline"):
            # a usage error, shown as such (like a bad magic argument), not a crash
            raise UsageError(
                f"no GUI event loop '{gui}' in a LooseLeaf worker: "
                "outputs render in the notebook (use %matplotlib inline)"
            )

    def ask_exit(self):
        # `exit`/`quit` in a cell must not end the worker.
        self.exit_now = False

    def run(self, code: str):
        """Run one cell as a kernel would; returns (ExecutionResult, error info)."""
        self.last_error = None
        try:
            result = self.run_cell(code, store_history=True, silent=False)
        finally:
            self.flush_streams()
        err = None
        if not result.success:
            err = self.last_error or _error_from(result)
        return result, err


_OWN_FILES = (os.path.dirname(os.path.abspath(__file__)) + os.sep, contextlib.__file__)


def _drop_interrupt_frame(tb) -> None:
    """An interrupt's traceback ends in the cell's code, as from ipykernel: the
    worker's own frames that raised it (its SIGINT handler, the shield around a
    frame exchange) are cut off the end (IPython never hides the innermost
    frame, even one marked ``__tracebackhide__``)."""
    last_theirs = None  # the innermost frame not of the worker's own making
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_OWN_FILES):
            last_theirs = tb
        tb = tb.tb_next
    if last_theirs is not None:
        last_theirs.tb_next = None


def _error_from(result) -> dict:
    e = result.error_in_exec or result.error_before_exec
    return {"ename": type(e).__name__, "evalue": str(e), "traceback": []}
