"""Run a notebook halfway in a LooseLeaf kernel, SIGKILL the kernel, and run the
rest in a new kernel on the same notebook, which takes over the session the
dead kernel left (ADR 63, 65); write the executed notebook and print one JSON line of what happened.
tests/detached.rs compares the notebook with a plain kernel's run (nbequiv).

Usage: resume_probe.py KERNEL_NAME NOTEBOOK EXECUTED FOLDER FRONTEND_URL
(with JUPYTER_PATH naming where the kernel is installed)
"""

import json
import os
import signal
import sys
import urllib.request

import nbformat
from nbclient import NotebookClient

NOTICE = "LooseLeaf: resumed"


def client(nb, kernel_name, folder):
    return NotebookClient(
        nb, kernel_name=kernel_name, timeout=600, startup_timeout=300, resources={"metadata": {"path": folder}}
    )


def session_of(frontend, notebook):
    """What the frontend lists of the session of `notebook`."""
    with urllib.request.urlopen(f"{frontend}/v1/sessions", timeout=10) as r:
        listed = json.load(r)
    mine = [s for s in listed if s.get("notebook") == notebook]
    if len(mine) != 1:
        sys.exit(f"resume_probe.py: not one session of {notebook}: {listed}")
    return mine[0]


def main():
    kernel_name, source, executed, folder, frontend = sys.argv[1:6]
    nb = nbformat.read(source, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    split = code[len(code) // 2]
    identity = "resume-probe/" + os.path.basename(source)
    os.environ.update(JPY_SESSION_NAME=identity, LOOSELEAF_FRONTEND=frontend, LOOSELEAF_LOG="error")

    first = client(nb, kernel_name, folder)
    with first.setup_kernel():
        for index in range(split):
            first.execute_cell(nb.cells[index], index)
        # the kernel dies with no word to anyone: its session must survive it
        os.kill(first.km.provisioner.process.pid, signal.SIGKILL)
        first.km.provisioner.process.wait()
    # still attached (the frontend detaches an unwatched session only after a
    # while): the next kernel takes over the session its dead kernel left
    killed = session_of(frontend, identity)

    second = client(nb, kernel_name, folder)
    notice = None
    with second.setup_kernel():
        for index in range(split, len(nb.cells)):
            cell = nb.cells[index]
            second.execute_cell(cell, index)
            if cell.cell_type == "code" and notice is None:
                said = [o for o in cell.outputs if o.get("name") == "stderr" and o.get("text", "").startswith(NOTICE)]
                notice = said[0]["text"] if said else ""
                # the line is LooseLeaf's, not the notebook's: left out of the comparison
                cell.outputs = [o for o in cell.outputs if o not in said]
    nbformat.write(nb, executed)
    print(json.dumps({"split": split, "cells": len(nb.cells), "killed": killed, "notice": notice}))


if __name__ == "__main__":
    main()
