"""`npm run build:labextension`: JupyterLab's federated-extension build, against
the JupyterLab of the Python that runs it (whose shared packages the extension
will load into).

`jupyter labextension build` does the same, but its builder looks the core's
versions up on npm's registry and GitHub, which a build machine may not reach;
JupyterLab's own staging folder holds them.
"""

import os
import subprocess
import sys

import jupyterlab

here = os.path.dirname(os.path.abspath(__file__))
core = os.path.join(os.path.dirname(jupyterlab.__file__), "staging")
builder = os.path.join(here, "node_modules", "@jupyterlab", "builder", "lib", "build-labextension.js")
sys.exit(subprocess.call(["node", builder, "--core-path", core, here], stdout=subprocess.DEVNULL))
