"""`Worker`: calls run in order on one background thread; the first error fails it for good.

A call's error is logged, the calls queued after it are skipped, and every
later `submit`, `wait`, `close` and `raise_if_failed` raises it on the caller's
thread. Work goes only through `queue.SimpleQueue`, whose `put` is re-entrant,
so `close` may run in a signal handler that interrupted a `submit` or `wait`
(a `ThreadPoolExecutor` would deadlock there).
"""

import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from absl import logging

from jaxline_ng.errors import OneLineError

# How often a waiting caller checks the thread still runs (a call queued after `close` never ends).
_LIVENESS_POLL_SECONDS = 1.0

_STOP = object()  # Queued by `close`, or once the Worker is garbage: the thread returns.


class Worker:
  """Runs submitted calls on one daemon thread, in order; the first error fails it for good.

  Args:
    name: the thread's name, also given in the logged error.
    max_pending: if set, `submit` blocks while this many calls are unfinished.
    on_idle: `(seconds, callback)`: the thread calls `callback` (e.g. a flush)
      once idle for `seconds` after running calls; it can fail the worker too.
    raise_as: makes the exception the caller's thread raises, with the first
      error as its `__cause__`; by default the error itself is raised.
  """

  def __init__(self, name: str, *, max_pending: int | None = None,
               on_idle: tuple[float, Callable[[], object]] | None = None,
               raise_as: Callable[[BaseException], BaseException] | None = None):
    if max_pending is not None and max_pending < 1:
      raise ValueError(f"max_pending must be >= 1, got {max_pending}.")
    self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
    # One token per call allowed to be pending, given back when the call finishes.
    self._slots = None if max_pending is None else queue.SimpleQueue()
    for _ in range(max_pending or 0):
      self._slots.put(None)
    self._errors: list[BaseException] = []  # The first error, once a call raised.
    self._raise_as = raise_as
    # The thread does not refer to this object, so a worker nobody holds is
    # stopped by its finalizer. A daemon: non-daemon threads are joined before
    # an owner's `atexit` handler could close it.
    self._thread = threading.Thread(target=_work, name=name, daemon=True,
                                    args=(name, self._calls, self._slots, self._errors, on_idle))
    self._start_lock = threading.Lock()
    weakref.finalize(self, self._calls.put, _STOP).atexit = False  # An owner may close at exit.
    # When the main thread ends, the calls so far run (as a ThreadPoolExecutor's
    # do) while importing still works: h5py, which TensorFlow loads, crashes the
    # interpreter if imported during `atexit`. The hook refers to the worker weakly.
    threading._register_atexit(_drain_at_exit, weakref.ref(self))

  def submit(self, fn: Callable[..., Any], /, *args: Any,
             **kwargs: Any) -> concurrent.futures.Future:
    """Queues `fn(*args, **kwargs)` to run after every call submitted before it.

    Returns:
      The call's future (result None if skipped after an earlier failure; after
      `close` it never runs).

    Raises:
      The first error of an earlier call (see `raise_as`).
    """
    if self._slots is not None:
      self._take(self._slots)
    self.raise_if_failed()
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._calls.put((future, fn, args, kwargs))
    self._start_thread()
    return future

  def _start_thread(self) -> None:
    """Starts the thread at the first call, as `ThreadPoolExecutor` does: it
    runs the call before the caller goes on, so a quick first call's error is
    raised by the next one, as jaxline's tests of `make_async` expect."""
    if self._thread.ident is None:
      with self._start_lock:
        if self._thread.ident is None:
          self._thread.start()

  def wait(self) -> None:
    """Blocks until every call submitted so far has finished or been skipped.

    Raises:
      The first error of any call so far (see `raise_as`).
    """
    self._drain()
    self.raise_if_failed()

  def close(self) -> None:
    """Lets the calls submitted so far finish, then ends the thread; again, only re-raises.

    Raises:
      The first error of any call (see `raise_as`).
    """
    self._calls.put(_STOP)
    if self._thread.ident is not None:  # Else nothing was ever submitted.
      self._thread.join()
    self.raise_if_failed()

  def _drain(self) -> None:
    if self._thread.ident is None:
      return  # Nothing was ever submitted.
    replies: queue.SimpleQueue[None] = queue.SimpleQueue()
    self._calls.put(replies)
    self._take(replies)

  def _take(self, replies: queue.SimpleQueue[None]) -> None:
    """Takes an item from `replies`, or returns once the thread has ended."""
    while self._thread.ident is None or self._thread.is_alive():
      try:
        replies.get(timeout=_LIVENESS_POLL_SECONDS)
        return
      except queue.Empty:
        pass

  def raise_if_failed(self) -> None:
    """Raises the first error of any call so far (see `raise_as`), without waiting."""
    if self._errors:
      error = self._errors[0]
      if self._raise_as is None:
        raise error
      raise self._raise_as(error) from error


def _work(name: str, calls: queue.SimpleQueue[Any], slots: queue.SimpleQueue[None] | None,
          errors: list[BaseException], on_idle: tuple[float, Callable[[], object]] | None):
  """The thread: runs what `calls` brings until `_STOP`."""
  idle_due = False  # Whether calls ran since the idle callback last did.
  while True:
    try:
      item = calls.get(timeout=on_idle[0] if idle_due else None)
    except queue.Empty:
      idle_due = False
      _run(name, errors, concurrent.futures.Future(), on_idle[1], (), {})
      continue
    if item is _STOP:
      return
    if isinstance(item, queue.SimpleQueue):  # From `_drain`: every call before it has finished.
      item.put(None)
      continue
    _run(name, errors, *item)
    del item  # Not kept while waiting: the call may refer to the Worker (see `__init__`).
    idle_due = on_idle is not None
    if slots is not None:
      slots.put(None)


def _run(name: str, errors: list[BaseException], future: concurrent.futures.Future,
         fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
  """Runs one call into `future`: skipped once a call failed; its own error fails the worker."""
  if not future.set_running_or_notify_cancel():
    return  # Cancelled while queued.
  if errors:
    future.set_result(None)
    return
  try:
    future.set_result(fn(*args, **kwargs))
  except BaseException as e:
    errors.append(e)
    if isinstance(e, OneLineError):  # Its message says it all (a full disk, bad input).
      logging.error("[jaxline_ng] Error in background thread %s: %s", name, e)
    else:
      logging.exception("[jaxline_ng] Error in background thread %s.", name)
    future.set_exception(e)


def _drain_at_exit(worker_ref: "weakref.ref[Worker]") -> None:
  """Threading exit hook: runs what was submitted so far; a failure is left to the owner."""
  worker = worker_ref()
  if worker is not None:
    worker._drain()
