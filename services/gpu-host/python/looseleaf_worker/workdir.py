"""The working directory as ambient state, a removed one included.

A cell may remove the folder it is in (``os.chdir(d); shutil.rmtree(d)``). A plain
kernel carries on: the cell succeeds and later cells run; ``os.getcwd()`` (and
``os.path.abspath``, ``Path.resolve``, ``%pwd``) raises FileNotFoundError,
creating a file by a relative path fails, ``os.chdir('..')`` goes back to the
parent and an absolute ``os.chdir`` leaves the situation behind. Nothing of the
worker's own may depend on ``os.getcwd()`` succeeding (``current``), and a
session spans many workers, so the next worker must be put in the same
situation, not silently back in the notebook's folder.

Decision: the ambient state records the path the process is in and whether that
directory was removed. Linux names a removed working directory in
``/proc/self/cwd`` (with " (deleted)" appended); where that cannot be read the
path is None. A worker that restores a removed working directory enters a
removed directory of its own: it makes one at the recorded path (or beside it,
when something lives at that path again: the kernel's directory was removed, a
new folder at the same path is not the one it is in; or in the temporary folder
when its parent is gone too or cannot be written), enters it and removes it. So
``os.getcwd()`` raises as in the kernel, relative paths fail as there, and
``..`` is the same parent where the parent still exists. A directory that existed
at the save but not at the restore is not this case: the session may have moved
to a host without the notebook's folder, and the worker stays where the host put
it (as before).
"""

from __future__ import annotations

import os
import tempfile

from . import quiet

_DELETED = " (deleted)"

# (the path recorded, the directory made for it) of the removed directory this
# worker entered at a restore: its saves record the session's path, not ours
_entered: tuple[str | None, str] | None = None


def current() -> str | None:
    """``os.getcwd()``, or None when the working directory was removed."""
    try:
        return os.getcwd()
    except OSError:  # FileNotFoundError: removed (others: unreadable parents)
        return None


def _proc_path() -> str | None:
    """The path of the working directory as the kernel names it, " (deleted)"
    left off; None where /proc cannot tell."""
    try:
        link = os.readlink("/proc/self/cwd")
    except OSError:
        return None
    return link[: -len(_DELETED)] if link.endswith(_DELETED) else link


def capture() -> dict:
    """The ambient entries of the working directory: ``cwd`` (its path) and,
    for a removed one, ``cwd_removed``."""
    cwd = current()
    if cwd is not None:
        return {"cwd": cwd}
    path = _proc_path()
    if _entered is not None and path == _entered[1]:
        path = _entered[0]  # the stand-in a restore made: the session's own path
    return {"cwd": path, "cwd_removed": True}


def restore(st: dict) -> None:
    """Enter the working directory ``st`` records (from ``capture``)."""
    if st.get("cwd_removed"):
        _enter_removed(st.get("cwd"))
        return
    try:
        os.chdir(st["cwd"])
    except OSError:
        pass  # gone since the save (another host?): the cell sees where the host put it


def _enter_removed(path: str | None) -> None:
    global _entered
    if current() is None and capture().get("cwd") == path:
        return  # a kept worker: it is in that removed directory already
    made = _make_beside(path)
    if made is None:
        quiet.log(f"looseleaf worker: could not enter a removed working directory for {path!r}")
        return
    try:
        os.chdir(made)
    except OSError as e:
        quiet.log(f"looseleaf worker: could not enter a removed working directory for {path!r}: {e}")
        return
    finally:
        try:
            os.rmdir(made)
        except OSError as e:
            quiet.log(f"looseleaf worker: could not remove the stand-in working directory {made!r}: {e}")
    _entered = (path, made)


def _make_beside(path: str | None) -> str | None:
    """A new empty directory: at ``path``, else beside it, else in the
    temporary folder; None when none can be made."""
    if path:
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            try:
                return tempfile.mkdtemp(prefix=os.path.basename(path.rstrip(os.sep)) + "-", dir=os.path.dirname(path))
            except OSError:
                pass
        except OSError:
            pass  # its parent is gone too, or not ours to write
    try:
        return tempfile.mkdtemp(prefix="looseleaf-removed-")
    except OSError:
        return None
