"""Assertions shared by the tests.

A run (``hostsim.Worker.run``) and a comm answer both hold ``messages``, the
CellMessages the worker sent in order (one key each, naming its kind); a run's
``outputs`` are the notebook outputs among them."""


def outputs(r: dict) -> list[dict]:
    """The notebook outputs (``{"output": ...}`` messages) of a run or a comm answer."""
    return [m["output"] for m in r["messages"] if "output" in m]


def of_kind(r: dict, kind: str) -> list[dict]:
    """The bodies of a run's or a comm answer's messages of one kind: output,
    comm, pager or user_expressions."""
    return [m[kind] for m in r["messages"] if kind in m]


def stream_text(r: dict, name: str = "stdout") -> str:
    return "".join(o["text"] for o in outputs(r) if o["output_type"] == "stream" and o["name"] == name)


def of_type(r: dict, output_type: str) -> list[dict]:
    return [o for o in outputs(r) if o["output_type"] == output_type]


def ok(run: dict) -> dict:
    assert run["finished"]["status"] == "ok", run["messages"]
    return run


def result_text(run: dict) -> str:
    res = of_type(ok(run), "execute_result")
    assert len(res) == 1, run["outputs"]
    return res[0]["data"]["text/plain"]
