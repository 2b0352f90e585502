"""The session's package layer: what `%pip install` and `!pip install` install.

In one kernel an install is there for every later cell. A session spans many
workers on many hosts, and a host's Python environment is shared by every session
(and by its zygotes), so installs from a cell go instead into a directory of the
session's own, which the host names in ``LOOSELEAF_PACKAGE_LAYER``
(``--package-layers DIR/<session>``; on several hosts, DIR is a shared file system,
as the working directories are). Every worker of the session puts it on
``sys.path`` right after the working directory, before the environment's
packages, so an installed version wins as in the kernel, and pip (run by the
magic or by a shell line) installs into it through ``PIP_TARGET``; subprocesses
see it through ``PYTHONPATH``. Zygotes never see a layer: nothing a session
installs is shared.
"""

from __future__ import annotations

import os
import sys

from . import quiet


def activate(layer: str | None) -> None:
    """Put the session's layer on the path and make pip install into it. Called
    before the worker's baseline, so none of this counts as a cell's doing."""
    if not layer:
        return
    try:
        # made up front: an entry that does not exist yet is cached as empty by
        # the import system and would stay invisible after the first install
        os.makedirs(layer, exist_ok=True)
    except OSError as e:
        quiet.log(f"looseleaf worker: package layer {layer}: {e}")
        return
    if layer not in sys.path:
        sys.path.insert(1 if sys.path[:1] == [""] else 0, layer)
    os.environ["PIP_TARGET"] = layer
    existing = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = layer if not existing else layer + os.pathsep + existing
