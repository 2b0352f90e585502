"""LooseLeaf's Python cell runtime, supervised by the Rust gpu-host.

Map (one concern per module):
  protocol    frames (4-byte big-endian length + JSON) and the contract in
              services/gpu-host/python/looseleaf_worker/worker-protocol.json, checked both ways
  zygote      imports packages once (CUDA-clean only), forks workers on demand
  worker      the per-worker loop: restore / run / save / committed / shutdown
  routing     which request (cell, comm message) a cell message (output, comm, pager,
              user_expressions), a thread's too, belongs to
  shell       an IPython shell whose outputs equal ipykernel's
  placement   %%gpu [N] / %%cpu lines; `%load_ext looseleaf_worker` in a plain kernel
  checkpoint  object records, payloads, 2 MiB xxh3-128 chunks; save and restore
              (a package: its __init__ maps its modules)
  ambient     session state that is not a variable (RNGs, rcParams, cwd, ...)
              (a package: its __init__ maps its modules)
  workdir     the working directory as ambient state, a removed one included
  localmods   modules beside the notebook, as the session imported them
  packages    the session's package layer (%pip install lands there)
  faults      eval/exec bring in names the closure missed
  quiet       the platform's own warnings and prints go to the host's log

Tests: cd services/gpu-host/python && python -m pytest -q tests
"""


def load_ipython_extension(shell) -> None:
    """``%load_ext looseleaf_worker`` in a plain kernel: LooseLeaf's ``%%gpu`` /
    ``%%cpu`` lines become no-ops there, so a notebook runs the same anywhere."""
    from .placement import load_ipython_extension as load

    load(shell)
