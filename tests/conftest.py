import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

from common.runtime import flush_denormals_active, set_flush_denormals  # noqa: E402


@pytest.fixture(autouse=True)
def _ieee_floats_in_every_test():
    """Every test starts and ends with IEEE gradual underflow on this thread.  A test that runs a client update
    (``configure_compute``) turns flush-to-zero on for this process; so would a module that called it at import
    time.  Without this, a test's floating-point behaviour would depend on which tests ran or were collected
    before it (hypothesis refuses to draw floats when subnormals are flushed)."""
    if flush_denormals_active():
        set_flush_denormals(False)
    yield
    if flush_denormals_active():
        set_flush_denormals(False)
