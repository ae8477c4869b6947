"""Room in XLA's CPU thread pool, so multi-device CPU runs never abort a collective.

A host dispatching far ahead of the devices can fill XLA's CPU pool with
waiting tasks, so that a collective, needing a thread per device at once,
never completes (XLA aborts after 40 s). Each dispatching thread holds at most
one waiting task per device, so `THREADS_PER_DEVICE` per device (training,
a multithreaded evaluator, the experiment's own threads, the collective) always
leaves room. It is asked for through `PJRT_NPROC` (unless the user set it) when
jaxline_ng is imported; a backend started before that fails at start (`check_pool`).
"""

import os
import re
import sys

import jax
from jax._src import xla_bridge

from jaxline_ng import errors

THREADS_PER_DEVICE = 6

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
# The value this module put in PJRT_NPROC, so a later call may raise it.
_reserved: list[str] = []


def _requested_cpu_devices() -> int:
  """How many CPU devices JAX will make, as far as can be known before it starts."""
  counts = [int(n) for n in _DEVICE_COUNT_FLAG.findall(os.environ.get("XLA_FLAGS", ""))]
  count = counts[-1] if counts else 1
  if os.environ.get("JAX_NUM_CPU_DEVICES", "").isdigit():
    count = max(count, int(os.environ["JAX_NUM_CPU_DEVICES"]))
  if "jax" in sys.modules:  # Set in code with jax.config.update("jax_num_cpu_devices", n).
    count = max(count, sys.modules["jax"].config.jax_num_cpu_devices)
  return count


def reserve_threads() -> None:
  """Sizes XLA's CPU pool for the devices asked for; takes effect if JAX's CPU
  backend has not started yet (it reads `PJRT_NPROC` when it starts)."""
  current = os.environ.get("PJRT_NPROC")
  if current is not None and current not in _reserved:
    return
  devices = _requested_cpu_devices()
  if devices <= 1:
    return
  threads = str(max(os.cpu_count() or 1, THREADS_PER_DEVICE * devices))
  os.environ["PJRT_NPROC"] = threads
  _reserved.append(threads)


class ThreadPoolError(RuntimeError, errors.OneLineError):
  """XLA's CPU pool started too small for the devices' collectives."""


def check_pool() -> None:
  """Sizes the pool if JAX's backend has not started; else makes sure it was
  sized in time.

  Raises:
    ThreadPoolError: the backend started before jaxline_ng was imported,
      with XLA's default pool for several CPU devices.
  """
  if not xla_bridge.backends_are_initialized():
    reserve_threads()
    return
  if not _started_before_import or _nproc_at_import is not None:
    return
  devices = jax.local_devices(backend="cpu") if jax.default_backend() == "cpu" else []
  needed = THREADS_PER_DEVICE * len(devices)
  if len(devices) > 1 and max(os.cpu_count() or 1, len(devices)) < needed:
    raise ThreadPoolError(
        f"JAX's CPU backend started before jaxline_ng was imported, with XLA's default thread "
        f"pool, too small for collectives over {len(devices)} CPU devices (they can abort or "
        f"hang): set PJRT_NPROC={needed} in the environment, or import jaxline_ng before the "
        "program first uses JAX")


# JAX has no public way to ask whether its backend has started (and so read
# PJRT_NPROC already); its own bridge module keeps that state.
_started_before_import = xla_bridge.backends_are_initialized()
_nproc_at_import = os.environ.get("PJRT_NPROC")
reserve_threads()
