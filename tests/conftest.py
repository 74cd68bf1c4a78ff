import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

from common.runtime import flush_denormals_active, set_flush_denormals  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_flush_denormals():
    """A test that runs a client update (``configure_compute``) turns flush-to-zero on in this process; put the
    mode back so that the next test's floating-point behaviour does not depend on the order of the tests."""
    before = flush_denormals_active()
    yield
    if flush_denormals_active() != before:
        set_flush_denormals(before)
