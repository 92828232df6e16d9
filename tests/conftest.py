import os
import sys

# Shared test helpers (toy_models.py) live next to this file; spawned worker
# processes inherit sys.path, so they can import them too.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A rank killed by a native crash signal fails the test at once (no retry).
# The rare crashes seen in CI were torch's functional all-gather on gloo, now
# worked around (docs/crashes.md); SIMPLEFSDP_CRASH_RETRIES=N reruns a test
# that crashed up to N times, with a warning; see run_distributed.
os.environ.setdefault("SIMPLEFSDP_CRASH_RETRIES", "0")

# SIMPLEFSDP_TEST_PRETEND_CUDA=1: CUDA looks visible (see pretend_cuda.py), to
# find device assumptions without a GPU.
from pretend_cuda import ENV_VAR as _PRETEND_CUDA  # noqa: E402

if os.environ.get(_PRETEND_CUDA) == "1":
    from pretend_cuda import pretend_cuda_visible

    pretend_cuda_visible()

_DEVICE_RUN = "test_device_assumptions.py::test_unit_tests_pass_with_cuda_visible"
_UNIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit")
_start_device_run = False


def pytest_collection_modifyitems(session, config, items):
    # The CUDA-visible rerun of the unit tests (test_device_assumptions.py)
    # starts beside the first unit test and its test waits for it last.
    global _start_device_run
    waiting = [item for item in items if item.nodeid.endswith(_DEVICE_RUN)]
    _start_device_run = bool(waiting) and os.environ.get(_PRETEND_CUDA) != "1"
    if waiting:
        items[:] = [item for item in items if item not in waiting] + waiting


def pytest_runtest_setup(item):
    if _start_device_run and str(item.path).startswith(_UNIT_DIR + os.sep):
        from pretend_cuda import start_cuda_visible_unit_run

        start_cuda_visible_unit_run(_UNIT_DIR)


def pytest_sessionfinish(session, exitstatus):
    from pretend_cuda import stop_cuda_visible_unit_run

    stop_cuda_visible_unit_run()
