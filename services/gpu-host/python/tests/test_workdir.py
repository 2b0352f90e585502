"""A working directory a cell removed behaves as in a plain kernel: the cell
succeeds, its state saves, later cells run (imports, tracebacks), and the next
worker is in a removed directory too: ``os.getcwd()`` raises FileNotFoundError,
relative paths fail, ``..`` is the same parent (see looseleaf_worker/workdir.py)."""

import pickle

from helpers import ok, result_text, stream_text

REMOVE = "import os, shutil\nos.chdir({d!r})\nshutil.rmtree({d!r})\nx = 1"

PROBE = (
    "try:\n    os.getcwd()\nexcept FileNotFoundError:\n    print('getcwd: FileNotFoundError')\n"
    "try:\n    open('rel.txt', 'w')\nexcept FileNotFoundError:\n    print('relative: FileNotFoundError')\n"
    "print(os.readlink('/proc/self/cwd'))"
)


def test_a_cell_that_removes_its_working_directory_succeeds_and_saves(host, zygote, tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "ll_beside.py").write_text("WHO = 'beside'\n")
    w = zygote.fork(cwd=str(tmp_path))
    ok(w.run(REMOVE.format(d=str(gone))))
    saved = w.save()["ready"]["delta"]
    assert "x" in saved["variables"]
    # later cells run: a first import (a path the notebook added), a traceback
    ok(w.run(f"import sys\nsys.path.append({str(tmp_path / 'lib')!r})\nimport ll_beside\nwho = ll_beside.WHO"))
    r = w.run("1/0")
    assert r["finished"]["status"] == "error"
    assert r["finished"]["error"]["ename"] == "ZeroDivisionError"
    assert stream_text(ok(w.run(PROBE))).splitlines() == [
        "getcwd: FileNotFoundError",
        "relative: FileNotFoundError",
        f"{gone} (deleted)",
    ]
    w.save()
    # a fresh worker: the module the session imported, in the same situation
    w2 = zygote.fork(cwd=str(tmp_path))
    assert w2.restore(["x", "who", "ll_beside", "os", "sys"])["ok"]
    assert result_text(ok(w2.run("x, who, ll_beside.WHO"))) == "(1, 'beside', 'beside')"
    assert stream_text(ok(w2.run(PROBE))).splitlines() == [
        "getcwd: FileNotFoundError",
        "relative: FileNotFoundError",
        f"{gone} (deleted)",
    ]
    assert not gone.exists()  # the stand-in is removed again
    assert stream_text(ok(w2.run("os.chdir('..')\nprint(os.getcwd())"))).strip() == str(tmp_path)


def test_a_folder_made_again_at_the_removed_path_is_not_the_working_directory(host, zygote, tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    w = zygote.fork(cwd=str(tmp_path))
    ok(w.run(REMOVE.format(d=str(gone))))
    w.save()
    # as in a kernel: a new folder at that path is not the one the session is in
    gone.mkdir()
    (gone / "keep.txt").write_text("kept")
    w2 = zygote.fork(cwd=str(tmp_path))
    assert w2.restore(["x", "os"])["ok"]
    lines = stream_text(ok(w2.run(PROBE))).splitlines()
    assert lines[:2] == ["getcwd: FileNotFoundError", "relative: FileNotFoundError"]
    assert (gone / "keep.txt").read_text() == "kept" and not (gone / "rel.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone"]  # the stand-in beside it is gone
    # its save records the session's path, not the stand-in's
    w2.save()
    assert pickle.loads(host.blob(host.ambient))["cwd"] == str(gone)
    # a worker restored again while it is in the removed directory stays there
    assert w2.restore(["x"], held=["x"])["ok"]
    assert stream_text(ok(w2.run(PROBE))).splitlines() == lines
    assert stream_text(ok(w2.run("os.chdir('..')\nprint(os.getcwd())"))).strip() == str(tmp_path)


def test_a_working_directory_whose_parent_is_gone_too(host, zygote, tmp_path):
    gone = tmp_path / "parent" / "gone"
    gone.mkdir(parents=True)
    w = zygote.fork(cwd=str(tmp_path))
    ok(w.run(f"import os, shutil\nos.chdir({str(gone)!r})\nshutil.rmtree({str(tmp_path / 'parent')!r})\nx = 1"))
    w.save()
    w2 = zygote.fork(cwd=str(tmp_path))
    assert w2.restore(["x", "os"])["ok"]
    assert stream_text(ok(w2.run(PROBE))).splitlines()[:2] == [
        "getcwd: FileNotFoundError",
        "relative: FileNotFoundError",
    ]
    assert not (tmp_path / "parent").exists()
    # an absolute path leaves the situation behind, as in a kernel
    assert result_text(ok(w2.run(f"os.chdir({str(tmp_path)!r})\nos.getcwd()"))) == repr(str(tmp_path))
