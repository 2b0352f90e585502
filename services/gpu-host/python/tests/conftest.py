import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostsim import HostSim  # noqa: E402


@pytest.fixture(scope="session")
def host():
    h = HostSim()
    yield h
    h.close()


@pytest.fixture(scope="session")
def zygote(host):
    """One zygote with the default head packages, shared by the suite."""
    return host.zygote(["numpy", "pandas"])


@pytest.fixture
def fresh_host():
    """A host with an empty store (for tests that count missing chunks)."""
    h = HostSim()
    yield h
    h.close()
