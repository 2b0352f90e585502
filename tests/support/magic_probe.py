"""Drive the `%looseleaf` magics through an installed LooseLeaf kernel (undo,
checkout, fork, a bad one) and print one JSON line of what each answered;
tests/undo.rs asserts on it.

Usage: magic_probe.py KERNEL_NAME (with JUPYTER_PATH naming where it is installed)
"""

import json
import sys

from jupyter_client.manager import start_new_kernel
from kernel_probe import TIMEOUT, run


def said(kc, code):
    """(status, what it printed, its error's evalue) of running `code`."""
    reply, outputs = run(kc, code)
    text = "".join(c.get("text", "") for kind, c in outputs if kind == "stream")
    return [reply["status"], text, reply.get("evalue", "")]


def main():
    km, kc = start_new_kernel(kernel_name=sys.argv[1], startup_timeout=TIMEOUT)
    try:
        seen = {}
        said(kc, "xs = [1, 2]")  # In[1]
        said(kc, "xs.append(3)")  # In[2]: in place
        seen["undo"] = said(kc, "%looseleaf undo")
        seen["after_undo"] = said(kc, "print(xs)")
        seen["checkout"] = said(kc, "%looseleaf checkout 2")
        seen["after_checkout"] = said(kc, "print(xs)")
        seen["unknown_execution"] = said(kc, "%looseleaf checkout 99")
        seen["bad_magic"] = said(kc, "%looseleaf rewind")
        seen["fork"] = said(kc, "%looseleaf fork")
        seen["still_here"] = said(kc, "print(xs)")
        print(json.dumps(seen))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


if __name__ == "__main__":
    main()
