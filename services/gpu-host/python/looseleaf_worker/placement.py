"""LooseLeaf's placement override on a cell's first line: ``%%gpu`` (one GPU),
``%%gpu N`` (N GPUs on one host) or ``%%cpu``. The planner reads it; the cell body
is ordinary code.

The same line must not break a notebook run on a plain Jupyter kernel, so this
module is also an IPython extension (``%load_ext looseleaf_worker``): an input
transformer drops a valid placement line before the cell runs, exactly as in a
LooseLeaf worker (which loads it too), and ``%%gpu``/``%%cpu`` magics explain a
malformed one instead of IPython's "cell magic not found".
"""

from __future__ import annotations

from IPython.core.error import UsageError

USAGE = "a cell's first line may be %%gpu, %%gpu N (N >= 1 GPUs on one host) or %%cpu"


def parse(line: str) -> tuple[str, int] | None:
    """``("gpu", N)`` or ``("cpu", 0)`` for a placement line, else None."""
    words = line.split()
    if not words or words[0] not in ("%%gpu", "%%cpu"):
        return None
    if words == ["%%cpu"]:
        return ("cpu", 0)
    if words == ["%%gpu"]:
        return ("gpu", 1)
    if len(words) == 2 and words[0] == "%%gpu" and words[1].isdigit() and int(words[1]) >= 1:
        return ("gpu", int(words[1]))
    return None


def strip_placement(code: str) -> str:
    """The cell without its placement line (unchanged if it has none)."""
    first, _sep, rest = code.partition("\n")
    return rest if parse(first) else code


def _drop_placement_line(lines: list[str]) -> list[str]:
    # an IPython cleanup transformer: runs before cell magics are recognised
    return lines[1:] if lines and parse(lines[0]) else lines


def _malformed(name: str):
    def magic(line: str, cell: str | None = None):
        raise UsageError(f"%%{name} {line.strip()}: {USAGE}")

    magic.__name__ = name
    magic.__doc__ = f"LooseLeaf's placement override: {USAGE}."
    return magic


def load_ipython_extension(shell) -> None:
    """Make placement lines no-ops in ``shell`` (idempotent)."""
    cleanup = shell.input_transformers_cleanup
    if _drop_placement_line not in cleanup:
        cleanup.append(_drop_placement_line)
    for name in ("gpu", "cpu"):
        shell.register_magic_function(_malformed(name), "cell", name)
