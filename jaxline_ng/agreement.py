"""What the processes of a run agree on without device collectives, and how a
failure in one ends them all.

Agreements go through the distributed runtime's key-value store, which any
thread may use (device collectives must stay on the training thread, see
`multihost`), and all take one form, `exchange`: processes publish a value
under a name and read the values of the processes they need, until a
process publishes a failure. Barriers (`rendezvous`), checks against process
0 (`check_same_as_chief`), the chief's saves awaiting the others' verdicts
(`guards.PeerChecks`) and an eval job's choice of checkpoint are exchanges.
A requested stop (SIGTERM to any process, Ctrl-C, the wall-clock budget) goes
through JAX's preemption service: every process learns of it and they agree
on the step to stop after (`stop_agreed`). A failure in one process is
published in the store, and every other process exits at once with the same
code (`exit_when_a_peer_fails`), instead of waiting in a collective that will
never complete.
"""

import atexit
import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
from absl import logging
from jax._src import distributed as jax_runtime
from jax.experimental import multihost_utils

from jaxline_ng import distributed, run_record
from jaxline_ng.distributed import MultihostError

# The key-value store key the first failing process writes; every process watches it.
_FAILURE_KEY = "jaxline_ng/failure"
# A wait (`wait_for`, e.g. for a key of the store) polls at most this far apart. JAX's
# blocking read is not used: each one that times out leaks native memory, in
# the process and in process 0's coordination service, where a read of a
# missing key leaks nothing. Every run's exit also waits for its watchers to
# notice they should stop, so this bounds that too.
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
# How often each barrier name has been passed, so a name can be used again.
_barriers: dict[str, int] = {}
# Set once this process has published a failure or is exiting after one.
_ending = threading.Event()
_watching = threading.Event()  # Set once `exit_when_a_peer_fails` started its watcher.
_exiting_for_peer = threading.Lock()  # Held by the thread ending this process for a peer.
# Written by each process about to exit because a process failed.
_EXITING_KEY = "jaxline_ng/exiting/{}"
# How long process 0 still waits once the others said they exit: they do so
# right after saying it, but the runtime's reply to them must arrive first.
_EXIT_AFTER_OTHERS_SECS = 1.0


def _key_value_store():
  # JAX has no public handle on its runtime's key-value store (orbax reads this
  # same one); jaxline_ng only calls its get and set methods.
  return jax_runtime.global_state.client


def key_value_set(key: str, value: str, allow_existing: bool = False) -> None:
  """Writes `key` once in the distributed runtime's key-value store.

  With `allow_existing`, a key another process wrote first is left as it is.
  """
  try:
    _key_value_store().key_value_set(key, value)
  except Exception as e:  # pylint: disable=broad-except
    if not (allow_existing and "ALREADY_EXISTS" in str(e)):
      raise


def key_value_try_get(key: str) -> str | None:
  """The value of `key` if some process wrote it, else None; one store read."""
  try:
    return _key_value_store().key_value_try_get(key)
  except Exception as e:  # pylint: disable=broad-except
    if "NOT_FOUND" in str(e):
      return None
    raise


def wait_for(look: Callable[[], Any], give_up: Callable[[], bool]) -> Any:
  """What `look()` returns once it is not None, or None once `give_up()` is true.

  Polls, soon after a call starts (what it waits for is usually near) and
  then every `_POLL_SECS`; `look` runs at least once, before each `give_up()`.
  """
  delay = 0.001
  while (value := look()) is None:
    if give_up():
      return None
    time.sleep(delay)
    delay = min(2 * delay, _POLL_SECS)
  return value


def begin_run() -> None:
  """Gives the `platform.main` call that starts now store keys of its own, and
  drops the callbacks an earlier call registered with `at_peer_failure`."""
  global _run_index  # pylint: disable=global-statement
  _run_index += 1
  _at_peer_failure.clear()


def run_key(name: str) -> str:
  """The key-value store key `name` of the current `platform.main` call."""
  return f"jaxline_ng/run{_run_index}/{name}"


def exchange(name: str, value: str | None, read_from: Iterable[int] | None = None,
             give_up: Callable[[], bool] = lambda: False) -> list[str] | None:
  """The one agreement between processes: each publishes a value under a name, and reads others'.

  Args:
    name: what the values are of, unique within the current `platform.main`
      call (`begin_run`); each process publishes a name at most once.
    value: this process's value for `name`, or None to publish nothing.
    read_from: the processes whose values to wait for (default every one);
      empty to only publish.
    give_up: asked while a value is missing; once true the wait ends. Each
      value is looked for at least once, so `lambda: True` reads without waiting.

  Returns:
    The `read_from` processes' values, in that order; None if one is missing
    when a process has published a failure or `give_up()` is true.
  """
  if value is not None:
    key_value_set(run_key(f"{name}/{jax.process_index()}"), value)
  values = []
  for process in range(jax.process_count()) if read_from is None else read_from:
    got = wait_for(functools.partial(key_value_try_get, run_key(f"{name}/{process}")),
                   give_up=lambda: give_up() or published_failure() is not None)
    if got is None:
      return None
    values.append(got)
  return values


def rendezvous(name: str = "jaxline_ng") -> None:
  """Blocks until every process reaches this point (a no-op with one process).

  A barrier in the key-value store, not a device collective: any thread may
  wait at it. Every process must pass the same names in the same order.
  Once a process has published a failure it returns at once: that failure
  ends this process too (`exit_when_a_peer_fails`).
  """
  if not distributed.is_multiprocess():
    return
  _barriers[name] = _barriers.get(name, 0) + 1
  exchange(f"rendezvous/{name}/{_barriers[name]}", "")


barrier = rendezvous


def check_same_as_chief(what: str, facts: Callable[[], dict[str, Any]], why: str) -> None:
  """Raises MultihostError naming the keys where this process's `facts()`
  (JSON-safe `{key: value}`) differ from process 0's: "process 1 {what}
  unlike process 0: ...; {why}".

  Process 0 publishes its facts and goes on; each other process takes its
  own once process 0's are published (so they may be facts of what process
  0 did first), compares, and gives up waiting when a failure is published
  (process 0's own is then the news). Each `what` is checked once per run.
  """
  if not distributed.is_multiprocess():
    return
  name = "as_chief/" + what.replace(" ", "_")
  if distributed.is_chief():
    exchange(name, json.dumps(facts()), read_from=())
    return
  chiefs = exchange(name, None, read_from=[0])
  if chiefs is None:
    return
  # Both as JSON reads them (tuples as lists), compared key by key.
  mine, chiefs = json.loads(json.dumps(facts())), json.loads(chiefs[0])
  differing = [key for key in sorted(set(mine) | set(chiefs))
               if not run_record.same_value(mine.get(key), chiefs.get(key))]
  if differing:
    if (failure := published_failure()) is not None:
      # Process 0 failed after publishing its facts, undoing what they
      # describe (its lock is released): its failure is the news, not the
      # difference.
      exit_for_peer(failure)
    shown = ", ".join(f"{key}={mine.get(key, '<absent>')!r} (process 0: "
                      f"{chiefs.get(key, '<absent>')!r})" for key in differing[:3])
    more = f" and {len(differing) - 3} more" if len(differing) > 3 else ""
    raise MultihostError(
        f"process {jax.process_index()} {what} unlike process 0: {shown}{more}; {why}")


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


def published_failure() -> str | None:
  """The failure a process published (`process code message`), or None; one store read."""
  return key_value_try_get(_FAILURE_KEY)


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
      failure = wait_for(published_failure, give_up=done.is_set)
    except Exception:  # pylint: disable=broad-except
      return  # The runtime is shutting down.
    if failure is not None and int(failure.split(" ", 1)[0]) != jax.process_index():
      exit_for_peer(failure)  # Else this process is exiting already.

  watcher = threading.Thread(target=watch, name="jaxline_ng_peer_failure", daemon=True)
  watcher.start()

  def stop_watching():
    done.set()
    watcher.join()

  # Runs before JAX's own shutdown of the runtime, registered when jax was imported.
  atexit.register(stop_watching)


def exit_for_peer(failure: str) -> None:
  """Ends this process with the exit code of the `published_failure()` another process gave.

  Once: a second thread that learns of the failure (the watcher, a wait that
  gave up on it) waits here for the first to end the process.
  """
  if not _exiting_for_peer.acquire(blocking=False):
    while True:
      time.sleep(60)
  process, exit_code, message = failure.split(" ", 2)
  process, exit_code = int(process), int(exit_code)
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
        wait_for(functools.partial(key_value_try_get, _EXITING_KEY.format(process)),
                 give_up=lambda: time.monotonic() > deadline)
      time.sleep(_EXIT_AFTER_OTHERS_SECS)
    except Exception:  # pylint: disable=broad-except  (the runtime is gone: nothing to wait for)
      pass
  os._exit(exit_code)  # pylint: disable=protected-access  (the main thread may never return)
