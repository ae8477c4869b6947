"""Starting JAX's distributed runtime, from jaxline_ng's flags.

A run spans several processes when `--jaxline_num_processes` (or
`$JAX_NUM_PROCESSES`) is above 1, or `--jaxline_distributed` asks JAX to
detect a cluster; `platform.main` calls `initialize_if_requested` first.
"""

import os
import socket
import sys
import threading

import jax
from absl import flags, logging

from jaxline_ng import errors, launch

# Environment variables that should hold an integer and do not: refused when
# the run starts, in one line, rather than with a traceback at import.
_BAD_ENV: dict[str, str] = {}


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    _BAD_ENV[name] = value
    return None


_COORDINATOR = flags.DEFINE_string(
    "jaxline_coordinator_address", os.environ.get("JAX_COORDINATOR_ADDRESS"),
    "host:port of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "jaxline_num_processes", _env_int("JAX_NUM_PROCESSES"),
    "Processes in the run (default: $JAX_NUM_PROCESSES); above 1 starts JAX's "
    "distributed runtime.")
_PROCESS_ID = flags.DEFINE_integer(
    "jaxline_process_id", _env_int("JAX_PROCESS_ID"),
    "This process's index, 0 to num_processes - 1 (default: $JAX_PROCESS_ID).")
_DISTRIBUTED = flags.DEFINE_bool(
    "jaxline_distributed", False,
    "Start JAX's distributed runtime with what JAX detects from the cluster "
    "(SLURM, Open MPI, Kubernetes, Cloud TPU); flags above override it.")
_JOIN_TIMEOUT = flags.DEFINE_integer(
    "jaxline_distributed_timeout", _env_int("JAXLINE_DISTRIBUTED_TIMEOUT") or 300,
    "Seconds every process may take to join the run before each one that has not "
    "ends naming its coordinator address (default: $JAXLINE_DISTRIBUTED_TIMEOUT, else "
    "300, JAX's own; the local launcher sets 30).")
# JAX's own wait outlasts ours: at its end it aborts the process naming nothing.
_JAX_TIMEOUT_MARGIN_SECS = 30


class MultihostError(RuntimeError, errors.OneLineError):
  """The run's processes cannot run together; the message names the flag or config key."""


def initialize_if_requested() -> bool:
  """Calls `jax.distributed.initialize` when the flags ask for a multi-process run.

  Must run before any JAX device is touched. Returns whether the run is a
  multi-process one (its runtime started now, or by an earlier call).
  """
  for name, value in _BAD_ENV.items():
    raise MultihostError(f"${name}={value!r} is not an integer")
  num_processes = _NUM_PROCESSES.value
  if num_processes is not None and num_processes < 1:
    raise MultihostError(f"--jaxline_num_processes={num_processes} must be at least 1")
  if not _DISTRIBUTED.value and (num_processes is None or num_processes <= 1):
    # A process given its place in a run but not the run's size would train
    # alone as process 0, writing where the real process 0 writes.
    if _PROCESS_ID.value:
      raise MultihostError(
          f"--jaxline_process_id={_PROCESS_ID.value} needs --jaxline_num_processes above 1 "
          "(or $JAX_NUM_PROCESSES)")
    if _COORDINATOR.present:
      raise MultihostError(
          f"--jaxline_coordinator_address={_COORDINATOR.value} needs --jaxline_num_processes "
          "above 1 (or $JAX_NUM_PROCESSES)")
    return False
  if not _DISTRIBUTED.value:
    if not _COORDINATOR.value:
      raise MultihostError(
          f"--jaxline_num_processes={num_processes} needs --jaxline_coordinator_address "
          "(or $JAX_COORDINATOR_ADDRESS)")
    port = _COORDINATOR.value.rpartition(":")[2]
    if not port.isdigit() or not 0 < int(port) < 65536:
      raise MultihostError(
          f"--jaxline_coordinator_address={_COORDINATOR.value} must be host:port, "
          "the port in 1..65535")
    if _PROCESS_ID.value is None or not 0 <= _PROCESS_ID.value < num_processes:
      raise MultihostError(
          f"--jaxline_process_id={_PROCESS_ID.value} must be in [0, {num_processes}) "
          "(or set $JAX_PROCESS_ID)")
    host = _COORDINATOR.value.rpartition(":")[0].strip("[]")
    try:  # JAX would retry a name that does not resolve for its whole timeout.
      socket.getaddrinfo(host, int(port))
    except OSError as e:
      raise MultihostError(f"--jaxline_coordinator_address={_COORDINATOR.value}: cannot "
                           f"resolve {host!r}: {e.strerror or e}") from None
  if jax.distributed.is_initialized():  # By an earlier `platform.main` call: JAX starts it once.
    if num_processes is not None and jax.process_count() != num_processes:
      raise MultihostError(
          f"--jaxline_num_processes={num_processes}, but the distributed runtime this "
          f"process started before has {jax.process_count()} processes")
    return True
  if not _DISTRIBUTED.value and _PROCESS_ID.value == 0:
    _refuse_a_taken_port(int(port))
  timeout = _JOIN_TIMEOUT.value
  if not timeout > 0:
    raise MultihostError(f"--jaxline_distributed_timeout={timeout} must be positive")
  where = _COORDINATOR.value or "the detected cluster's coordinator"
  # JAX's join timeout aborts without a word: at ours a waiting process names its address.
  logging.info("[jaxline_ng] Process %s of %s: joining at %s; every process must join within "
               "%d s (--jaxline_distributed_timeout).", _PROCESS_ID.value, num_processes, where,
               timeout)
  joined = threading.Event()

  def give_up_joining():
    if not joined.wait(timeout):
      print(f"jaxline_ng: error: process {_PROCESS_ID.value} of {num_processes}: the run's "
            f"processes did not all join at {where} within {timeout:g} s "
            "(--jaxline_distributed_timeout): was every process given process 0's address "
            "and started?", file=sys.stderr, flush=True)
      os._exit(1)  # pylint: disable=protected-access  (the main thread waits inside JAX)

  threading.Thread(target=give_up_joining, name="jaxline_ng_join", daemon=True).start()
  try:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=num_processes, process_id=_PROCESS_ID.value,
                               initialization_timeout=timeout + _JAX_TIMEOUT_MARGIN_SECS)
  except (RuntimeError, ValueError) as e:
    if "before any JAX" in str(e):
      # jaxline never started the runtime, so code written for it may use
      # JAX first (build the experiment, count devices) and still run there.
      raise MultihostError(
          "this program used JAX before platform.main, which must start JAX's distributed "
          "runtime first: call jax.distributed.initialize() at the top of main, or move the "
          "JAX calls after platform.main starts") from None
    raise MultihostError(f"jax.distributed.initialize failed: {e}") from None
  finally:
    joined.set()
  logging.info("[jaxline_ng] Process %d of %d; %d local devices of %d.",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def _refuse_a_taken_port(port: int) -> None:
  """Raises MultihostError if process 0's coordinator `port` is in use on this host."""
  if launch.port_in_use(port):
    raise MultihostError(
        f"--jaxline_coordinator_address={_COORDINATOR.value}: port {port} is in use on "
        "this host (process 0 of another run still alive, or two processes given "
        "--jaxline_process_id=0?)")


def is_chief() -> bool:
  """Process 0 writes summaries and checkpoints unless a `*_all_hosts` key says otherwise."""
  return jax.process_index() == 0


def is_multiprocess() -> bool:
  """Whether JAX's distributed runtime runs with more than one process."""
  return jax.distributed.is_initialized() and jax.process_count() > 1
