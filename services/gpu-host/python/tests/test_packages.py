"""`%pip install` and `!pip install` land in the session's package layer: every
later worker of the session imports the package, another session's does not, and
the environment the host shares between sessions is untouched."""

import subprocess
import sys
import zipfile

from helpers import ok, result_text


def _wheel(dirpath) -> str:
    """A pure-Python wheel built here: no index is needed to install it."""
    whl = dirpath / "llwheeldemo-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("llwheeldemo/__init__.py", "VALUE = 42\n")
        z.writestr("llwheeldemo-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: llwheeldemo\nVersion: 0.1\n")
        z.writestr(
            "llwheeldemo-0.1.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: looseleaf-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr("llwheeldemo-0.1.dist-info/RECORD", "")
    return str(whl)


def test_installs_from_a_cell_are_the_sessions_own(zygote, tmp_path):
    whl = _wheel(tmp_path)
    mine = {"LOOSELEAF_PACKAGE_LAYER": str(tmp_path / "layers" / "s1")}
    w1 = zygote.fork(env=mine, cwd=str(tmp_path))
    r = w1.run(f"%pip install -q --no-index --no-deps --disable-pip-version-check {whl}")
    assert r["finished"]["status"] == "ok", r["outputs"]
    assert result_text(ok(w1.run("import llwheeldemo\nllwheeldemo.VALUE"))) == "42"
    # a later worker of the session has it without installing; a shell line's
    # Python sees it too, as in the kernel's environment
    w2 = zygote.fork(env=mine, cwd=str(tmp_path))
    assert result_text(ok(w2.run("import llwheeldemo\nllwheeldemo.VALUE"))) == "42"
    r = ok(w2.run("out = !python -c 'import llwheeldemo; print(llwheeldemo.VALUE)'\nout"))
    assert result_text(r) == "['42']"
    # another session's worker does not, and the shared environment is untouched
    other = zygote.fork(env={"LOOSELEAF_PACKAGE_LAYER": str(tmp_path / "layers" / "s2")}, cwd=str(tmp_path))
    r = other.run("import llwheeldemo")
    assert r["finished"]["error"]["ename"] == "ModuleNotFoundError"
    plain = subprocess.run([sys.executable, "-c", "import llwheeldemo"], capture_output=True)
    assert plain.returncode != 0
