"""The Jupyter project's kernel conformance suite (jupyter_kernel_test) against an
installed LooseLeaf kernel: `python -m unittest kernel_conformance` with
LOOSELEAF_TEST_KERNEL naming the kernelspec (tests/kernel.rs installs one).

The kernel tests.rs installs runs every cell serverless, so completion and
inspection here come from the session's code (no CPU worker holds live objects).
"""

import os
import unittest

import jupyter_kernel_test


class LooseLeafKernelTests(jupyter_kernel_test.KernelTests):
    kernel_name = os.environ.get("LOOSELEAF_TEST_KERNEL", "looseleaf")
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "print?"
    completion_samples = [{"text": "zi", "matches": {"zip"}}, {"text": "import collec", "matches": {"collections"}}]
    code_inspect_sample = "print"
    code_generate_error = "raise"
    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data = [
        {"code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))", "mime": "text/html"},
        {"code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))", "mime": "text/latex"},
    ]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "range", "search")
    code_clear_output = "from IPython.display import clear_output; clear_output()"


if __name__ == "__main__":
    unittest.main()
