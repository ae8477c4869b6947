"""Multi-process runs: starting JAX's distributed runtime, and helpers for them.

A run spans several processes when `--jaxline_num_processes` (or the
`JAX_NUM_PROCESSES` environment variable) is above 1, or when
`--jaxline_distributed` asks JAX to detect a cluster (SLURM, Open MPI,
Kubernetes, Cloud TPU). `platform.main` then calls `jax.distributed.initialize`
before anything touches a device. Locally, `python -m jaxline_ng.launch` starts
the processes and sets the environment for them.

Within a run, `jax.local_devices()` are this process's devices; a pmap maps
over them and its collectives (`psum`, `pmean`) reduce over every process's
devices. Process 0 is the chief: it writes summaries and checkpoints unless a
`*_all_hosts` config key says otherwise.

Processes stop together. A requested stop (SIGTERM to any process, Ctrl-C,
the wall-clock budget) goes through JAX's preemption service: every process
learns of it and they agree on the step to stop after (`stop_agreed`). A
failure in one process is published in the distributed runtime's key-value
store, and every other process exits at once with the same code
(`exit_when_a_peer_fails`), instead of waiting in a collective that will
never complete.

One rule keeps multi-process runs from deadlocking: every process issues its
cross-process device collectives in the same order. A collective here is any
computation over devices of several processes (a jitted step over global
arrays, `process_allgather`, and `jax.device_put` of a host value onto such
devices, which checks the value agrees across processes with one). jaxline_ng
issues them on the training thread only (the thread running `train` or
`evaluate`, which `own_collectives` names); everything it does across
processes from other threads (stop agreement, failures, checks, barriers) goes
through the distributed runtime's key-value store instead. The helpers below
that run a collective refuse another thread, so a prefetch thread that would
issue one stops naming it instead of hanging the run.
"""

import atexit
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import flags, logging
from jax.experimental import multihost_utils

from jaxline_ng import launch, run_record

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


class MultihostError(RuntimeError):
  """The distributed runtime could not start; the message names the flag."""
  one_line = True  # Reported as one line naming the culprit, not a traceback.


_JOIN_TIMEOUT = flags.DEFINE_integer(
    "jaxline_distributed_timeout", _env_int("JAXLINE_DISTRIBUTED_TIMEOUT") or 300,
    "Seconds every process may take to join the run before each one that has not "
    "ends naming its coordinator address (default: $JAXLINE_DISTRIBUTED_TIMEOUT, else "
    "300, JAX's own; the local launcher sets 30).")
# JAX's own wait outlasts ours: at its end it aborts the process naming nothing.
_JAX_TIMEOUT_MARGIN_SECS = 30


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
  if jax.distributed.is_initialized():
    # An earlier `platform.main` call of this program started it (JAX starts
    # it once a process); process 0's own coordinator holds the port now.
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
  # The wait for every process to join cannot fail early (a peer may start
  # late), and JAX's timeout aborts the process without a word: at ours each
  # process still waiting says which address it was given, and ends.
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


def rendezvous(name: str = "jaxline_ng") -> None:
  """Blocks until every process reaches this point (a no-op with one process).

  A barrier in the key-value store, not a device collective: any thread may
  wait at it. Every process must pass the same names in the same order.
  Once a process has published a failure it returns at once: that failure
  ends this process too (`exit_when_a_peer_fails`).
  """
  if not is_multiprocess():
    return
  _barriers[name] = _barriers.get(name, 0) + 1
  every_process_value(f"rendezvous/{name}/{_barriers[name]}", "")


# How often each barrier name has been passed, so a name can be used again.
_barriers: dict[str, int] = {}
# The thread that issues this process's cross-process collectives.
_collectives_thread: threading.Thread | None = None


def own_collectives() -> None:
  """Makes the calling thread the one that issues cross-process collectives
  (`train` and `evaluate` call it as they start)."""
  global _collectives_thread  # pylint: disable=global-statement
  _collectives_thread = threading.current_thread()


def _check_collective_thread(what: str) -> None:
  """Raises CollectiveThreadError if a collective would be issued off the training thread."""
  thread = threading.current_thread()
  if is_multiprocess() and _collectives_thread not in (None, thread):
    raise CollectiveThreadError(
        f"{what} is a collective across processes, called on thread {thread.name!r}: every "
        "process must issue collectives in one order, so call it from step or evaluate (the "
        f"training thread, {_collectives_thread.name!r}), never from a prefetch or other "
        "background thread")


class CollectiveThreadError(RuntimeError):
  """A cross-process collective was called off the training thread."""


barrier = rendezvous


def host_slice(global_rows: Any) -> Any:
  """This process's share of arrays whose leading axis spans every device.

  For a global batch of `jax.device_count() * k` rows (or `jax.device_count()`
  per-device groups) each process keeps its contiguous `1 / process_count`;
  processes then load only their own data. Raises ValueError if the leading
  axis does not split evenly.
  """
  count, index = jax.process_count(), jax.process_index()

  def take(rows):
    rows = np.asarray(rows)
    share, remainder = divmod(rows.shape[0], count)
    if remainder:
      raise ValueError(f"host_slice: {rows.shape[0]} rows do not split over {count} processes")
    return rows[index * share:(index + 1) * share]

  return jax.tree.map(take, global_rows)


def global_batch(local_batch: Any, mesh: jax.sharding.Mesh, spec: Any) -> Any:
  """Assembles per-process rows into global `jax.Array`s sharded by `spec` over `mesh`.

  Each process passes its own rows (its `host_slice` of the global batch);
  the result is the global batch, every process's rows in process order,
  for jit / shard_map code (pmap code passes local arrays). When `spec`
  puts rows on a process's devices that another process holds (a mesh
  whose batch axis does not span the processes, such as `data:1,model:4`
  over 2 processes, or a replicated batch), every call first gathers all
  processes' rows, a collective: the training thread may do that, a
  prefetch thread uses `global_batch_from_every_row` instead.

  Raises:
    CollectiveThreadError: a gather is needed off the training thread.
  """
  sharding = jax.sharding.NamedSharding(mesh, spec)
  count = jax.process_count()

  def assemble(rows):
    rows = np.asarray(rows)
    if count == 1 or rows.ndim == 0:
      return jax.make_array_from_process_local_data(sharding, rows)
    global_shape = (count * rows.shape[0], *rows.shape[1:])
    if not _holds_its_own_rows(sharding, global_shape):
      # Every process decides alike (same sharding and shapes), so all gather.
      _check_collective_thread(
          f"global_batch over mesh {dict(mesh.shape)} with PartitionSpec{tuple(spec)} (it "
          "gathers rows other processes load; global_batch_from_every_row does not)")
      rows = np.asarray(multihost_utils.process_allgather(rows, tiled=True))
    return jax.make_array_from_process_local_data(sharding, rows, global_shape)

  return jax.tree.map(assemble, local_batch)


def global_batch_from_every_row(batch: Any, mesh: jax.sharding.Mesh, spec: Any) -> Any:
  """Global `jax.Array`s sharded by `spec` over `mesh`, from the whole batch.

  Every process passes the same rows (data that is a function of the step
  and seed); each places only the rows its devices hold. Nothing is
  communicated, so a prefetch thread may call it, where `jax.device_put` of
  the batch would check with a collective that the processes agree.
  """
  sharding = jax.sharding.NamedSharding(mesh, spec)

  def place(rows):
    rows = np.asarray(rows)
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])

  return jax.tree.map(place, batch)


@functools.cache
def _holds_its_own_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> bool:
  """Whether the devices of each process `p` hold exactly its `host_slice`:
  rows `[p * share, (p + 1) * share)` of the leading axis, nothing else."""
  share = global_shape[0] // jax.process_count()
  blocks: dict[int, set[tuple[int, int]]] = {}
  for device, index in sharding.devices_indices_map(global_shape).items():
    start, stop, _ = index[0].indices(global_shape[0])
    blocks.setdefault(device.process_index, set()).add((start, stop))
  for process, held in blocks.items():
    end = process * share
    for start, stop in sorted(held):
      if start != end:
        return False
      end = stop
    if end != (process + 1) * share:
      return False
  return True


def broadcast_from_chief(tree: Any) -> Any:
  """Process 0's value of `tree` on every process (e.g. a seed or a file list)."""
  if jax.process_count() == 1:
    return tree
  _check_collective_thread("broadcast_from_chief")
  return multihost_utils.broadcast_one_to_all(tree)


def all_reduce_sum(tree: Any) -> Any:
  """The sum over processes of each process's host values (numpy arrays or numbers)."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  _check_collective_thread("all_reduce_sum")
  gathered = multihost_utils.process_allgather(tree)
  return jax.tree.map(lambda x: np.asarray(x).sum(axis=0), gathered)


# The key-value store key the first failing process writes; every process watches it.
_FAILURE_KEY = "jaxline_ng/failure"
# A wait for a key of the store polls it at most this far apart. JAX's
# blocking read is not used: each one that times out leaks ~30 KB of native
# memory in the process and more in process 0's coordination service (several
# GB a day for a watcher renewing it every second), where a read of a missing
# key leaks nothing. Every run's exit also waits for its watchers to notice
# they should stop, so this bounds that too.
_POLL_SECS = 0.1
# How long the callbacks registered with `at_peer_failure` (pending saves,
# writer flushes) may take before the process exits anyway: they can wait on
# a step that a dead peer's collective blocks.
_PEER_FAILURE_FLUSH_SECS = 10.0
_at_peer_failure: list[Callable[[], None]] = []
# Which `platform.main` call of this program runs (`begin_run`): published
# code may call it twice (train, then evaluate), and every process makes the
# same calls, so one call's store keys (`run_key`) never meet another's.
_run_index = 0


def begin_run() -> None:
  """Gives the `platform.main` call that starts now store keys of its own, and
  drops the callbacks an earlier call registered with `at_peer_failure`."""
  global _run_index  # pylint: disable=global-statement
  _run_index += 1
  _at_peer_failure.clear()


def run_key(name: str) -> str:
  """The key-value store key `name` of the current `platform.main` call."""
  return f"jaxline_ng/run{_run_index}/{name}"


def is_multiprocess() -> bool:
  """Whether JAX's distributed runtime runs with more than one process."""
  return jax.distributed.is_initialized() and jax.process_count() > 1


def _key_value_store():
  # JAX has no public handle on its runtime's key-value store (orbax reads this
  # same one); jaxline_ng only calls its get and set methods.
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  return distributed.global_state.client


def give_preemption_notice() -> None:
  """Starts JAX's preemption protocol from this process, as the scheduler's SIGTERM does.

  `jax.distributed.initialize` installs JAX's SIGTERM handler, which is how
  its preemption service hears of a notice; signalling this process is the
  public way to give one.
  """
  os.kill(os.getpid(), signal.SIGTERM)


def stop_agreed(step: int) -> bool:
  """Whether every process agreed to stop now, after `step` steps.

  JAX's preemption sync point: once any process has a preemption notice,
  each reports the last step it passed here and all agree on the step after
  the furthest; this returns True on every process at that step. Call it
  with the step training starts from, then after every step. Until a notice
  arrives it sets a counter under a lock: no communication.

  Once this process is ending after a failure (`exit_after_failure`), the
  call never returns: JAX's sync point can wait for processes that are gone
  while holding the GIL, which the thread ending the process needs.
  """
  if _ending.is_set():
    while True:
      time.sleep(60)
  return multihost_utils.reached_preemption_sync_point(step)


# Set once this process has published a failure or is exiting after one.
_ending = threading.Event()


def at_peer_failure(callback: Callable[[], None]) -> None:
  """Runs `callback` (e.g. a writer flush) before exiting because another process failed."""
  _at_peer_failure.append(callback)


def publish_failure(message: str, exit_code: int) -> None:
  """Tells every other process this one failed; they exit with `exit_code` too."""
  _ending.set()
  try:
    _key_value_store().key_value_set(
        _FAILURE_KEY, f"{jax.process_index()} {exit_code} {message}")
  except Exception:  # pylint: disable=broad-except
    # Another process's failure came first (the key exists), or the runtime
    # is gone; either way the others hear of a failure or are already ending.
    logging.warning("[jaxline_ng] Could not publish this process's failure; "
                    "another process's failure may have come first.")


def key_value_set(key: str, value: str, allow_existing: bool = False) -> None:
  """Writes `key` once in the distributed runtime's key-value store.

  With `allow_existing`, a key another process wrote first is left as it is.
  """
  try:
    _key_value_store().key_value_set(key, value)
  except Exception as e:  # pylint: disable=broad-except
    if not (allow_existing and "ALREADY_EXISTS" in str(e)):
      raise


def key_value_wait(key: str, give_up: Callable[[], bool]) -> str | None:
  """The value of `key` once some process writes it, or None once `give_up()` is true.

  Polls the store, soon after a call starts (an agreement is usually near)
  and then every `_POLL_SECS`, asking `give_up` before each look.
  """
  delay = 0.001
  while not give_up():
    value = key_value_try_get(key)
    if value is not None:
      return value
    time.sleep(delay)
    delay = min(2 * delay, _POLL_SECS)
  return None


def every_process_value(name: str, value: str) -> list[str] | None:
  """Publishes this process's `value` for `name` (a `run_key`) and returns
  every process's, in process order; None once a process published a failure."""
  key_value_set(run_key(f"{name}/{jax.process_index()}"), value)
  values = []
  for process in range(jax.process_count()):
    got = key_value_wait(run_key(f"{name}/{process}"),
                         give_up=lambda: published_failure() is not None)
    if got is None:
      return None
    values.append(got)
  return values


def key_value_try_get(key: str) -> str | None:
  """The value of `key` if some process wrote it, else None; one store read."""
  try:
    return _key_value_store().key_value_try_get(key)
  except Exception as e:  # pylint: disable=broad-except
    if "NOT_FOUND" in str(e):
      return None
    raise


def check_same_launch(launch: dict[str, Any]) -> None:
  """Raises MultihostError naming the keys where this process's `launch` (JSON-safe
  `{key: value}`: the mode, the flattened config) differs from process 0's.

  Processes launched differently run different steps and collectives, and
  would wait on each other until a runtime timeout with an error that names
  nothing.
  """
  check_same_as_chief("was launched", lambda: launch,
                      "every process of a run takes the same mode and config")


def check_same_as_chief(what: str, facts: Callable[[], dict[str, Any]], why: str) -> None:
  """Raises MultihostError naming the keys where this process's `facts()`
  (JSON-safe `{key: value}`) differ from process 0's: "process 1 {what}
  unlike process 0: ...; {why}".

  Process 0 publishes its facts and goes on; each other process takes its
  own once process 0's are published (so they may be facts of what process
  0 did first), compares, and gives up waiting when a failure is published
  (process 0's own is then the news). Each `what` is checked once per run.
  """
  if not is_multiprocess():
    return
  key = run_key("as_chief/" + what.replace(" ", "_"))
  if is_chief():
    key_value_set(key, json.dumps(facts()))
    return
  chiefs = key_value_wait(key, give_up=lambda: published_failure() is not None)
  if chiefs is None:
    return
  # Both as JSON reads them (tuples as lists), compared key by key.
  mine, chiefs = json.loads(json.dumps(facts())), json.loads(chiefs)
  differing = [key for key in sorted(set(mine) | set(chiefs))
               if not run_record.same_value(mine.get(key), chiefs.get(key))]
  if differing:
    if (failure := published_failure()) is not None:
      # Process 0 failed after publishing its facts, undoing what they
      # describe (its lock is released): its failure is the news, not the
      # difference.
      process, exit_code, message = failure.split(" ", 2)
      _exit_for_peer(int(process), int(exit_code), message)
    shown = ", ".join(f"{key}={mine.get(key, '<absent>')!r} (process 0: "
                      f"{chiefs.get(key, '<absent>')!r})" for key in differing[:3])
    more = f" and {len(differing) - 3} more" if len(differing) > 3 else ""
    raise MultihostError(
        f"process {jax.process_index()} {what} unlike process 0: {shown}{more}; {why}")


# Written by each process about to exit because a process failed.
_EXITING_KEY = "jaxline_ng/exiting/{}"
# How long process 0 still waits once the others said they exit: they do so
# right after saying it, but the runtime's reply to them must arrive first.
_EXIT_AFTER_OTHERS_SECS = 1.0


def exit_after_failure(exit_code: int) -> None:
  """Ends this process at once after a process failed (this one or a peer).

  Skips the graceful shutdown: JAX's distributed shutdown at interpreter
  exit waits for every process, which would hang. Process 0 hosts JAX's
  coordination service; gone first, it would make the others' runtime
  clients abort their process (SIGABRT) before they exit with `exit_code`.
  So each process says it is exiting, as the last thing it does, and
  process 0 waits for every other one, the failed one included (it
  publishes its failure, then comes here), to say so (at most
  `_PEER_FAILURE_FLUSH_SECS` and a margin) before it exits.
  """
  _ending.set()
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    key_value_set(_EXITING_KEY.format(jax.process_index()), "")
  except Exception:  # pylint: disable=broad-except  (the runtime is gone already)
    pass
  others = range(1, jax.process_count())
  if jax.process_index() == 0 and others:
    deadline = time.monotonic() + _PEER_FAILURE_FLUSH_SECS + 5.0
    try:
      for process in others:
        key_value_wait(_EXITING_KEY.format(process), give_up=lambda: time.monotonic() > deadline)
      time.sleep(_EXIT_AFTER_OTHERS_SECS)
    except Exception:  # pylint: disable=broad-except  (the runtime is gone: nothing to wait for)
      pass
  os._exit(exit_code)  # pylint: disable=protected-access  (the main thread may never return)


def published_failure() -> str | None:
  """The failure a process published (`process code message`), or None; one store read."""
  return key_value_try_get(_FAILURE_KEY)


_watching = threading.Event()  # Set once `exit_when_a_peer_fails` started its watcher.


def exit_when_a_peer_fails() -> None:
  """Starts a daemon thread that ends this process when another process publishes a failure.

  Without it a failed peer leaves this process waiting in a collective until
  the runtime's heartbeat times out (100 s), and the rest of the run with it.
  Once per process: a later `platform.main` call keeps the first watcher.
  """
  if _watching.is_set():
    return
  _watching.set()
  done = threading.Event()

  def watch():
    try:
      value = key_value_wait(_FAILURE_KEY, give_up=done.is_set)
    except Exception:  # pylint: disable=broad-except
      return  # The runtime is shutting down.
    if value is None:
      return
    process, exit_code, message = value.split(" ", 2)
    if int(process) != jax.process_index():  # Else this process is exiting already.
      _exit_for_peer(int(process), int(exit_code), message)

  watcher = threading.Thread(target=watch, name="jaxline_ng_peer_failure", daemon=True)
  watcher.start()

  def stop_watching():
    done.set()
    watcher.join()

  # Runs before JAX's own shutdown of the runtime, registered when jax was imported.
  atexit.register(stop_watching)


def _exit_for_peer(process: int, exit_code: int, message: str) -> None:
  logging.error("[jaxline_ng] Process %d failed (%s); process %d exits with code %d too, "
                "once the saves it made before are written.", process, message,
                jax.process_index(), exit_code)

  def flush():
    for callback in _at_peer_failure:
      try:
        callback()
      except Exception:  # pylint: disable=broad-except  (the peer's failure is the news)
        logging.exception("[jaxline_ng] While exiting after process %d failed:", process)

  flushing = threading.Thread(target=flush, daemon=True)
  flushing.start()
  flushing.join(timeout=_PEER_FAILURE_FLUSH_SECS)
  exit_after_failure(exit_code)
