"""What the processes of a run agree on without device collectives, and how a
failure in one ends them all.

Every agreement is an `exchange` in the distributed runtime's key-value store
(any thread may use it): barriers, checks against process 0, save verdicts, an
eval job's choice. A stop is agreed through JAX's preemption sync point
(`stop_agreed`). A failure is published, and every other process exits at once
with its code (`exit_when_a_peer_fails`) rather than wait in a collective.
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
# The longest gap between a wait's polls: JAX's blocking read leaks native memory
# at each timeout, a read of a missing key nothing. It also bounds a run's exit.
_POLL_SECS = 0.1
# How long `at_peer_failure` callbacks may take: a dead peer's collective can block them.
_PEER_FAILURE_FLUSH_SECS = 10.0
_at_peer_failure: list[Callable[[], None]] = []
# Which `platform.main` call of this program runs (`begin_run`), so that one
# call's store keys (`run_key`) never meet another's.
_run_index = 0
# How often each barrier name has been passed, so a name can be used again.
_barriers: dict[str, int] = {}
# Set once this process has published a failure or is exiting after one.
_ending = threading.Event()
_watching = threading.Event()  # Set once `exit_when_a_peer_fails` started its watcher.
_exiting_for_peer = threading.Lock()  # Held by the thread ending this process for a peer.
# Written by each process about to exit because a process failed.
_EXITING_KEY = "jaxline_ng/exiting/{}"
# Process 0's wait once the others said they exit, for the runtime's reply to reach them.
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

  Polls soon after the call, then every `_POLL_SECS`; `look` runs before each `give_up()`.
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

  Any thread may wait at it; every process passes the same names in the same
  order. Returns once a process has published a failure (which ends this one).
  """
  if not distributed.is_multiprocess():
    return
  _barriers[name] = _barriers.get(name, 0) + 1
  exchange(f"rendezvous/{name}/{_barriers[name]}", "")


barrier = rendezvous


def check_same_as_chief(what: str, facts: Callable[[], dict[str, Any]], why: str) -> None:
  """Raises MultihostError naming the keys where this process's `facts()` (JSON-safe)
  differ from process 0's: "process 1 {what} unlike process 0: ...; {why}".

  Process 0 publishes and goes on; the others take their facts once its are
  published (so they may follow what it did). Each `what` once per run.
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
    if (failure := published_failure()) is not None:  # Process 0's failure is the news.
      exit_for_peer(failure)
    shown = ", ".join(f"{key}={mine.get(key, '<absent>')!r} (process 0: "
                      f"{chiefs.get(key, '<absent>')!r})" for key in differing[:3])
    more = f" and {len(differing) - 3} more" if len(differing) > 3 else ""
    raise MultihostError(
        f"process {jax.process_index()} {what} unlike process 0: {shown}{more}; {why}")


def give_preemption_notice() -> None:
  """Starts JAX's preemption protocol from this process, as the scheduler's SIGTERM does
  (the public way: JAX's runtime installs the SIGTERM handler its service hears by)."""
  os.kill(os.getpid(), signal.SIGTERM)


def stop_agreed(step: int) -> bool:
  """Whether every process agreed to stop now, after `step` steps.

  JAX's preemption sync point: once any process has a notice, all agree on
  the step after the furthest reported; no communication before. Call it with
  the start step, then after every step. Never returns once this process is
  ending after a failure: the sync point could wait for gone processes holding
  the GIL, which the ending thread needs.
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
  """Starts a daemon thread that ends this process when another process publishes a
  failure (else it waits in a collective until the runtime's heartbeat times out).
  Once per process."""
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
  """Ends this process with the exit code of the `published_failure()` another process
  gave; a second thread that learns of it waits here for the first to end it."""
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

  Skips JAX's shutdown, which waits for every process. Process 0 hosts the
  coordination service, whose going first would abort the others (SIGABRT),
  so it waits (bounded) until each other process has said it is exiting.
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
