"""An IPython shell whose outputs equal a Jupyter kernel's.

InteractiveShell is made to behave like ipykernel's ZMQInteractiveShell: rich
displays and execute results go out as nbformat outputs, stdout/stderr become
stream outputs, tracebacks become error outputs. Only the transport differs:
every output goes to ``emit`` as a CellMessage (``{"output": output_dict}``),
and the worker frames it; the pager's text goes there as ``{"pager": ...}``.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

# ipykernel sets this before the shell exists so that pyplot picks the inline
# backend, which registers its flush-at-cell-end hook on the live shell.
os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"

from IPython.core import page  # noqa: E402
from IPython.core.compilerop import CachingCompiler  # noqa: E402
from IPython.core.displayhook import DisplayHook  # noqa: E402
from IPython.core.displaypub import DisplayPublisher  # noqa: E402
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.formatters import DisplayFormatter  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from IPython.core.magic import Magics, line_magic, magics_class  # noqa: E402
from IPython.core.magics.basic import MagicsDisplay  # noqa: E402
from traitlets import Type  # noqa: E402

from . import placement  # noqa: E402

# Takes a CellMessage (worker-protocol.json): one key, its kind
# ("output", "comm", "pager", "user_expressions").
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


class WorkerDisplayFormatter(DisplayFormatter):
    """ipykernel builds the formatters at the first output, from the config of
    that moment: a ``%config PlainTextFormatter...`` before it applies, one after
    it does not. A worker has them built in its zygote: until the session formats
    its first output, a config change reaches them as it would new ones."""

    formatted = False  # the session has formatted an output (ambient state)

    def format(self, obj, include=None, exclude=None):
        self.formatted = True
        return super().format(obj, include, exclude)

    def update_config(self, config):
        super().update_config(config)
        if not self.formatted:
            for f in self.formatters.values():
                f.update_config(config)


# The displayhook's copy of `_`, `__` or `___` when this worker lacks the name: the
# session's value is brought in when a result rotates it.
MISSING = object()


class WorkerDisplayHook(DisplayHook):
    """Like ipykernel's ZMQShellDisplayHook: the last expression's value becomes an
    execute_result with the cell's execution_count."""

    def update_user_ns(self, result):
        # a result rotates _ into __ and __ into ___: the session's values, not
        # this worker's (a cell's closure brings only the names it reads); one a
        # cell assigned stays as IPython leaves it, unchanged
        ns, user_set = self.shell.user_ns, self.shell.unders_user_set
        for name in ("_", "__", "___"):
            if getattr(self, name) is not MISSING:
                continue
            wanted = name != "___" or name in user_set
            if wanted and name in self.shell.unders_in_session and name not in ns and self.shell.fault_in is not None:
                self.shell.fault_in(name)
            setattr(self, name, object() if name in user_set and name in ns else ns.get(name, ""))
        super().update_user_ns(result)

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


def _murmur2_x86(data: str, seed: int) -> int:
    """ipykernel's hash of a cell's code (ipykernel/compiler.py), which names the
    cell's file; importing ipykernel would bring zmq and jupyter_client."""
    m = 0x5BD1E995
    raw = data.encode("utf8")
    length = len(raw)
    h = seed ^ length
    rounded_end = length & 0xFFFFFFFC
    for i in range(0, rounded_end, 4):
        k = raw[i] | (raw[i + 1] << 8) | (raw[i + 2] << 16) | (raw[i + 3] << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = length & 0x03
    k = 0
    if tail == 3:
        k = raw[rounded_end + 2] << 16
    if tail in (2, 3):
        k |= raw[rounded_end + 1] << 8
    if tail in (1, 2, 3):
        k |= raw[rounded_end]
        h ^= k
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


class CellCompiler(CachingCompiler):
    """Names a cell's code as ipykernel does, ``/tmp/ipykernel_<pid>/<hash>.py``:
    warnings and syntax errors name that file (a SyntaxError its base name)."""

    def get_code_name(self, raw_code, code, number):
        name = _murmur2_x86(raw_code, 0xC70F6907)
        return f"{tempfile.gettempdir()}{os.sep}ipykernel_{os.getpid()}{os.sep}{name}.py"


_NO_CONNECTION_FILE = RuntimeError("app not specified, and not in a running Kernel")


@magics_class
class KernelMagics(Magics):
    """The magics ipykernel's shell adds, as they behave in a kernel without a
    connection file (a worker has none: its client is the LooseLeaf frontend)."""

    @line_magic
    def edit(self, parameter_s="", last_call=None):
        """Bring up an editor and execute the resulting code (as in ipykernel:
        the client is asked to open the file; a notebook ignores it)."""
        from IPython.core.magics.code import CodeMagics, MacroToEdit

        opts, args = self.parse_options(parameter_s, "prn:")
        try:
            filename, lineno, _ = CodeMagics._find_edit_target(self.shell, args, opts, last_call or ["", ""])
        except MacroToEdit:
            print("Macro editing not yet implemented in 2-process model.")
            return
        payload = {"source": "edit_magic", "filename": str(Path(filename).resolve()), "line_number": lineno}
        self.shell.payload_manager.write_payload(payload)

    @line_magic
    def clear(self, arg_s):
        """Clear the terminal."""
        self.shell.system("clear" if os.name == "posix" else "cls")

    @line_magic
    def less(self, arg_s):
        """Show a file through the pager.

        Files ending in .py are syntax-highlighted."""
        if not arg_s:
            raise UsageError("Missing filename.")
        if arg_s.endswith(".py"):
            from IPython.utils import openpy

            cont = self.shell.pycolorize(openpy.read_py_file(arg_s, skip_encoding_cookie=False))
        else:
            with open(arg_s) as fid:
                cont = fid.read()
        page.page(cont)

    more = line_magic("more")(less)

    @line_magic
    def man(self, arg_s):
        """Find the man page for the given command and display in pager."""
        page.page(self.shell.getoutput(f"man {arg_s} | col -b", split=False))

    @line_magic
    def connect_info(self, arg_s):
        """Print information for connecting other clients to this kernel

        It will print the contents of this session's connection file, as well as
        shortcuts for local clients. A LooseLeaf worker has no connection file."""
        warnings.warn(f"Could not get connection info: {_NO_CONNECTION_FILE!r}", stacklevel=2)

    @line_magic
    def qtconsole(self, arg_s):
        """Open a qtconsole connected to this kernel.

        A LooseLeaf worker has no connection file: as under a headless client
        (nbclient), nothing opens and the cell shows nothing."""
        from . import quiet

        quiet.log(f"looseleaf worker: %qtconsole: could not start qtconsole: {_NO_CONNECTION_FILE!r}")

    @line_magic
    def autosave(self, arg_s):
        """Set the autosave interval in the notebook (in seconds).

        The default value is 120, or two minutes.
        ``%autosave 0`` will disable autosave.

        This magic only has an effect when called from the notebook interface.
        It has no effect when called in a startup file.
        """
        from IPython.display import Javascript, display

        try:
            interval = int(arg_s)
        except ValueError as e:
            raise UsageError(f"%autosave requires an integer, got {arg_s!r}") from e
        display(
            Javascript(f"IPython.notebook.set_autosave_interval({1000 * interval})"),
            include=["application/javascript"],
        )
        print(f"Autosaving every {interval} seconds" if interval else "Autosave disabled")


class _Listing(MagicsDisplay):
    """``%lsmagic`` without LooseLeaf's own magics (placement lines), in both of
    its representations."""

    def _jsonable(self):
        magics = self.magics_manager.magics
        return {
            kind: {name: cls for name, cls in names.items() if magics[kind][name] not in self.ignore}
            for kind, names in super()._jsonable().items()
        }


@magics_class
class BasicMagics(Magics):
    """IPython's %lsmagic, under the name of its class there (%lsmagic lists it)."""

    @line_magic
    def lsmagic(self, parameter_s=""):
        """List currently available magic functions.

        ``%lsmagic --all`` lists LooseLeaf's own magics too."""
        mm = self.shell.magics_manager
        ours = []
        if parameter_s.strip() != "--all":
            ours = [fn for kind in mm.magics.values() for fn in kind.values() if _is_looseleaf_magic(fn)]
        return _Listing(mm, ignore=ours)


def _is_looseleaf_magic(fn) -> bool:
    return getattr(fn, "__module__", None) == placement.__name__


def _shell_part(path: tuple):
    """The live shell (``get_ipython()``) or one of its parts, in this worker."""
    obj = InteractiveShell.instance()
    for step in path:
        obj = obj[step] if isinstance(obj, dict) else getattr(obj, step)
    return obj


# Parts of the shell a notebook keeps in variables (``plain =
# ip.display_formatter.formatters['text/plain']``): they pickle as the same part
# of the shell of the worker that restores them, not as detached copies.
_PARTS = (
    "display_formatter",
    "events",
    "history_manager",
    "displayhook",
    "display_pub",
    "magics_manager",
    "extension_manager",
    "alias_manager",
    "payload_manager",
    "InteractiveTB",
    "SyntaxTB",
    "compile",
    "inspector",
    "prefilter_manager",
)


def _reduce_part(obj):
    shell = InteractiveShell._instance
    hit = getattr(shell, "_parts", {}).get(id(obj))
    if hit is not None and hit[0] is obj:
        return (_shell_part, (hit[1],))
    return obj.__reduce_ex__(4)  # another object of the type: pickled as usual


class WorkerShell(InteractiveShell):
    """The cell runtime. ``emit`` receives each CellMessage: an nbformat output
    dict as ``{"output": ...}``, the pager's text as ``{"pager": ...}``."""

    display_pub_class = WorkerDisplayPublisher
    displayhook_class = WorkerDisplayHook
    compiler_class = Type(CellCompiler)

    def __init__(self, emit: Emit, **kw):
        self._emit = emit
        self._streams: dict[str, OutputStream] = {}
        self.last_error: dict | None = None
        # brings a name of the session into the namespace while a cell runs (the
        # worker sets it; see sync_output_history)
        self.fault_in: Callable[[str], bool] | None = None
        # the runtime's own work around each cell's run (ambient state)
        self.before_cell: list[Callable[[], None]] = []
        self.after_cell: list[Callable[[], None]] = []
        # `_`, `__`, `___` the session has, and those a cell assigned (ambient state)
        self.unders_in_session: list[str] = []
        self.unders_user_set: list[str] = []
        super().__init__(**kw)
        # `%%gpu [N]` / `%%cpu` lines were read by the planner: the body runs
        placement.load_ipython_extension(self)
        # as ipykernel's ZMQInteractiveShell
        self.register_magics(KernelMagics, BasicMagics)
        self.magics_manager.register_alias("ed", "edit")
        self.extension_manager.load_extension("storemagic")  # IPython's apps load it (%store)
        self._register_parts()
        self._streams = {"stdout": OutputStream("stdout", self), "stderr": OutputStream("stderr", self)}
        sys.stdout = self._streams["stdout"]
        sys.stderr = self._streams["stderr"]
        # The display formatters are built on first use (~0.5 ms, ~1.7 ms in a
        # forked worker); built here, in the zygote, every worker has them.
        _ = self.display_formatter.formatters

    def __reduce__(self):
        # `ip = get_ipython()` in a cell: in a later worker, that worker's shell
        return (_shell_part, ((),))

    def _register_parts(self) -> None:
        parts = {name: getattr(self, name) for name in _PARTS}
        parts.update({("display_formatter", "formatters", m): f for m, f in self.display_formatter.formatters.items()})
        self._parts = {}
        for name, obj in parts.items():
            path = name if isinstance(name, tuple) else (name,)
            self._parts[id(obj)] = (obj, path)
            copyreg.pickle(type(obj), _reduce_part)

    def sync_output_history(self, fault_in: Callable[[str], bool], held: set[str]) -> None:
        """After a restore: the displayhook's `_`, `__`, `___` are those of the
        session this worker holds (``held``); the others are faulted in with
        ``fault_in`` when a result rotates them. A fresh shell's placeholders
        ('') go: saved, they would replace the session's values."""
        self.fault_in = fault_in
        dh, ns = self.displayhook, self.user_ns
        for name in ("_", "__", "___"):
            if name not in held:
                ns.pop(name, None)
            if name not in ns:
                setattr(dh, name, MISSING)
            else:  # one a cell assigned: results leave it alone, as IPython does
                setattr(dh, name, object() if name in self.unders_user_set else ns[name])
        # Out[N] is the same object as _N: rebuild the output history from them
        out = ns.get("Out")
        if isinstance(out, dict):
            out.clear()
            out.update({int(n[1:]): v for n, v in ns.items() if n[:1] == "_" and n[1:].isdigit()})

    def init_display_formatter(self):
        self.display_formatter = WorkerDisplayFormatter(parent=self)
        self.configurables.append(self.display_formatter)

    def init_history(self):
        # History lives in memory: ambient state carries it between workers,
        # and a sqlite file per worker would only cost time.
        self.config.HistoryManager.hist_file = ":memory:"
        super().init_history()

    def bind(self, emit: Emit) -> None:
        """Send cell messages to ``emit`` from now on (a zygote makes the shell before it
        forks; each worker binds it to its own socket)."""
        self._emit = emit

    def emit(self, output: dict) -> None:
        """Send a notebook output (or a change to those shown)."""
        self._emit({"output": output})

    def emit_message(self, message: dict) -> None:
        """Send a CellMessage of any kind (``{"pager": ...}``)."""
        self._emit(message)

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
        self.emit_message({"pager": {"data": jsonable(data), "start": max(0, start)}})

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
        # not IPython's events: an interrupt in them is the cell's, not a
        # callback's error
        for fn in self.before_cell:
            fn()
        try:
            result = self.run_cell(code, store_history=True, silent=False)
            for fn in self.after_cell:
                fn()
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
