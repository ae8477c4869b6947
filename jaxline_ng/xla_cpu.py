"""Room in XLA's CPU thread pool, so multi-device CPU runs never abort a collective.

XLA's CPU client runs each device's share of a computation as a task on one
thread pool, and a task waits on its pool thread while its device already
has many computations in flight. A host that dispatches far ahead of the
devices can so fill every thread with waiting tasks that a collective in
progress, which needs a thread for every device at once, never completes:
after 40 s XLA aborts the process ("Termination timeout ... only k of n
threads arrived", exit 134). Each thread that dispatches holds at most one
waiting task per device, so a pool of (dispatching threads + 1) threads per
device always leaves the collective room, whatever the experiment's `step`
returns or keeps. jaxline_ng asks for `THREADS_PER_DEVICE` per device
through `PJRT_NPROC` before JAX starts its CPU backend (this module runs
when any part of jaxline_ng is imported): enough for the training thread,
its two logging threads (which stack the scalars they read on the devices),
the evaluator of `train_eval_multithreaded` and one thread of the
experiment's own. A `PJRT_NPROC` set by the user is left alone.
"""

import os
import re
import sys

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


reserve_threads()
