import pytest
from helpers import of_type, ok, result_text, stream_text


@pytest.fixture(scope="module")
def w(zygote):
    return zygote.fork()


def test_print_is_stream(w):
    r = ok(w.run("print('a'); print('b')"))
    assert of_type(r, "stream") == [{"output_type": "stream", "name": "stdout", "text": "a\nb\n"}]


def test_stderr_and_warnings(w):
    r = ok(w.run("import sys, warnings\nsys.stderr.write('oops\\n')\nwarnings.warn('careful')"))
    err = stream_text(r, "stderr")
    assert "oops" in err and "UserWarning: careful" in err


def test_expression_is_execute_result(w):
    r = w.run("6 * 7")
    res = of_type(ok(r), "execute_result")[0]
    assert res["data"] == {"text/plain": "42"}
    assert res["execution_count"] == r["started"]["execution_count"] == r["finished"]["execution_count"]


def test_dataframe_html(w):
    r = ok(w.run("import pandas as pd\npd.DataFrame({'x': [1, 2]})"))
    data = of_type(r, "execute_result")[0]["data"]
    assert "<table" in data["text/html"] and "x" in data["text/plain"]


def test_matplotlib_png(w):
    r = ok(w.run("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3]);"))
    disp = of_type(r, "display_data")
    assert len(disp) == 1 and disp[0]["data"]["image/png"].startswith("iVBOR")
    r = ok(w.run("%matplotlib inline\nplt.figure(); plt.plot([3, 1]);"))
    assert len(of_type(r, "display_data")) == 1


def test_display_call(w):
    r = ok(w.run("from IPython.display import display, HTML\ndisplay(HTML('<b>x</b>'))"))
    assert of_type(r, "display_data")[0]["data"]["text/html"] == "<b>x</b>"


def test_shell_commands(w):
    r = ok(w.run("!echo hi"))
    assert stream_text(r).strip() == "hi"
    assert result_text(w.run("x = !echo yo\nx")) == "['yo']"


def test_error_output_and_finished(w):
    r = w.run("print('before')\n1/0")
    assert stream_text(r) == "before\n"
    err = of_type(r, "error")[0]
    assert err["ename"] == "ZeroDivisionError" and err["evalue"] == "division by zero"
    assert any("ZeroDivisionError" in line for line in err["traceback"])
    f = r["finished"]
    assert f["status"] == "error" and f["error"]["ename"] == "ZeroDivisionError"
    assert result_text(w.run("'still alive'")) == "'still alive'"


def test_syntax_error(w):
    r = w.run("def (")
    assert of_type(r, "error")[0]["ename"] == "SyntaxError"
    assert r["finished"]["status"] == "error"


def test_system_exit_does_not_kill_worker(w):
    for code in ["raise SystemExit(1)", "raise KeyboardInterrupt", "exit()"]:
        w.run(code)
    assert result_text(w.run("1 + 1")) == "2"


def test_execution_counts(zygote):
    w = zygote.fork()
    counts = [w.run(c)["finished"]["execution_count"] for c in ["1", "1/0", "def (", "2"]]
    assert counts == [1, 2, 3, 4]
    r = w.run("_1 + _4, In[2]")
    assert result_text(r) == "(3, '1/0')"
    assert r["started"]["unix_ms"] > 1_600_000_000_000
    assert r["finished"]["run_ms"] >= 0 and r["finished"]["cuda_used"] is False


def test_placement_override_line_is_not_run():
    from looseleaf_worker.placement import parse, strip_placement

    assert strip_placement("%%gpu\nx = 1") == "x = 1"
    assert strip_placement("%%gpu 4\nx = 1") == "x = 1"
    assert strip_placement("%%cpu\n") == ""
    assert strip_placement("%%time\nx = 1") == "%%time\nx = 1"
    assert strip_placement("x = 1  # %%gpu") == "x = 1  # %%gpu"
    assert strip_placement("%%gpu two\nx = 1") == "%%gpu two\nx = 1", "malformed: left for the magic"
    assert [parse(x) for x in ("%%gpu", "%%gpu 2", "%%cpu", "%%gpu 0", "%%cpu 2", "%%gpux")] == [
        ("gpu", 1),
        ("gpu", 2),
        ("cpu", 0),
        None,
        None,
        None,
    ]


def test_placement_lines_are_no_ops_in_a_plain_ipython_shell():
    # what a notebook using %%gpu gets on a plain Jupyter kernel after
    # `%load_ext looseleaf_worker`: the body runs, its value displays, errors are its own
    import looseleaf_worker
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_cell("%load_ext looseleaf_worker")
        r = shell.run_cell("%%gpu 2\nx = 20\nx + 1", store_history=True)
        assert r.success and r.result == 21 and shell.user_ns["x"] == 20
        r = shell.run_cell("%%cpu\n%%capture out\nprint('hidden')")
        assert r.success and shell.user_ns["out"].stdout == "hidden\n"
        r = shell.run_cell("%%gpu\n1 / 0")
        assert isinstance(r.error_in_exec, ZeroDivisionError)
        r = shell.run_cell("%%gpu two\nx = 3")
        assert not r.success and "%%gpu N (N >= 1 GPUs on one host)" in str(r.error_in_exec)
        assert shell.user_ns["x"] == 20, "a malformed placement runs nothing"
        looseleaf_worker.load_ipython_extension(shell)  # loading twice adds nothing twice
        assert shell.input_transformers_cleanup.count(shell.input_transformers_cleanup[-1]) == 1
    finally:
        InteractiveShell.clear_instance()


def test_streams_split_only_at_line_ends(host, zygote):
    """A slow loop of prints spans several stream outputs; none ends mid-line."""
    w = zygote.fork()
    r = w.run("import time\nfor i in range(6):\n    print('line', i)\n    time.sleep(0.09)")
    texts = [o["text"] for o in r["outputs"] if o["output_type"] == "stream"]
    assert len(texts) > 1
    assert all(t.endswith("\n") for t in texts), texts
    assert "".join(texts) == "".join(f"line {i}\n" for i in range(6))


def test_a_gui_event_loop_is_a_usage_error_and_the_worker_goes_on(host, zygote):
    w = zygote.fork()
    r = w.run("%gui qt")
    text = str(r["outputs"]) + str(r["finished"].get("error"))
    assert "no GUI event loop 'qt'" in text and "%matplotlib inline" in text, r
    assert "NotImplementedError" not in text
    assert stream_text(ok(w.run("print('still here')"))).strip() == "still here"
