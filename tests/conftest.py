"""Test-session set-up: fake CPU devices, set before JAX is imported anywhere.

Four devices exercise the per-device code paths (leading axes, rng
specialisation) while keeping collectives cheap on a 2-core CI machine.
tests/README.md explains how the suite avoids XLA's CPU collective deadlock.

Every process of the session (pytest workers and the runs they launch,
which inherit the environment) shares one JAX compilation cache, caching
even the toy's millisecond compilations: most launched runs compile what an
earlier one did, and compiling is much of a short run's CPU.

What tests share for starting runs (paths, the toy's command line, the
launcher's, one run to its end) is in helpers.py, imported as `helpers`.
"""

import os
import shutil
import tempfile

# The runs a test launches inherit these; one that needs another device count
# appends its own --xla_force_host_platform_device_count (the last one counts).
# The tests run each program they compile for a few steps: XLA's backend
# optimisation and newer CPU emitters would be a sixth of the suite's CPU.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# NumPy's BLAS threads would spin up in each of the hundreds of processes the
# suite starts, for linear algebra no test does.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Made once, by the process xdist's workers inherit it from (never a cache of the user's).
_made_cache = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _made_cache = tempfile.mkdtemp(prefix="jaxline_ng_tests_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _made_cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402  (JAX reads the variables above when it is first used)


def pytest_unconfigure(config):
  del config
  if _made_cache is not None:
    shutil.rmtree(_made_cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def fresh_in_memory_checkpoints(monkeypatch):
  """Each test starts with no in-memory checkpoints, as a new process would."""
  from jaxline_ng import utils  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {})
