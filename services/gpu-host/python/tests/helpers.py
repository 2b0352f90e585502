"""Assertions shared by the tests."""


def stream_text(run: dict, name: str = "stdout") -> str:
    return "".join(o["text"] for o in run["outputs"] if o["output_type"] == "stream" and o["name"] == name)


def of_type(run: dict, output_type: str) -> list[dict]:
    return [o for o in run["outputs"] if o["output_type"] == output_type]


def ok(run: dict) -> dict:
    assert run["finished"]["status"] == "ok", run["outputs"]
    return run


def result_text(run: dict) -> str:
    res = of_type(ok(run), "execute_result")
    assert len(res) == 1, run["outputs"]
    return res[0]["data"]["text/plain"]
