"""LooseLeaf's JupyterLab extension, as a prebuilt labextension.

The wheel puts the built extension into share/jupyter/labextensions, where any
JupyterLab 4 of the environment finds it; nothing here runs in the server.
"""

try:
    from ._version import __version__
except ImportError:  # a checkout that was never built
    __version__ = "dev"


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": "looseleaf-jupyterlab"}]
