"""Test CUDA probe: 'CUDA is initialised' once ll_fake_cuda is imported."""

import sys


def probe():
    return "ll_fake_cuda" in sys.modules
