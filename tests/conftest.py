"""Test-session set-up: fake CPU devices, set before JAX is imported anywhere.

Four devices exercise the per-device code paths (leading axes, rng
specialisation) while keeping collectives cheap on a 2-core CI machine.
tests/README.md explains how the suite avoids XLA's CPU collective deadlock.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402  (JAX reads the variables above when it is first used)


@pytest.fixture(autouse=True)
def fresh_in_memory_checkpoints(monkeypatch):
  """Each test starts with no in-memory checkpoints, as a new process would."""
  from jaxline_ng import utils  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {})
