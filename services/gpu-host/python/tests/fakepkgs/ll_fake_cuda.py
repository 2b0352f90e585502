"""Test package that 'initialises CUDA' as far as ll_probe can tell."""

INITIALISED = True
