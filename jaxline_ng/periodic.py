"""Periodic actions (logging, checkpointing) run between training steps.

An action is called after every step with `(t, step, scalars)` and decides
cheaply whether it is due: every `interval` seconds or steps, and optionally
also at the early steps of a growth schedule (ratios (1, 2, 5) act at steps
1, 2, 5, 10, 20, 50, 100, ...). Due work runs on the action's own background
thread unless `run_async=False`, so a slow action does not stall the loop.

The background thread takes due steps in batches: steps that fall due
queue on the loop's side (a list append) while it is busy and for at least
`_BATCH_SECONDS` after the previous batch, then go together: the loop's
thread stacks their scalars on the devices (one dispatch; the background
thread never dispatches) and the background thread copies the stacks to
the host. Acting every step therefore costs the loop next to nothing, and
wakes the thread a few times a second.
"""

import collections
import concurrent.futures
import functools
import math
from typing import Any, Callable, Optional, Sequence

import jax

from jaxline_ng import devices

# A background action is handed the steps that fell due at most this often
# (as the loop calls it): each hand-over wakes its thread, which on a machine
# with fewer cores than busy threads takes time from the devices. Acting
# every step at 1,000 steps/s then costs ~10 wake-ups a second, not 1,000.
_BATCH_SECONDS = 0.1


def make_async(thread_name_prefix: str = ""):
  """Decorator: calls run on one background thread, in call order.

  Each call returns a `concurrent.futures.Future`. An exception raised by an
  earlier call is raised again by the next call (and by `.wait()`), so
  failures surface on the caller's thread instead of vanishing.
  """

  def decorator(fn):
    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=thread_name_prefix or fn.__name__)
    unchecked: collections.deque[concurrent.futures.Future] = collections.deque()

    def raise_failures(block: bool) -> None:
      while unchecked and (block or unchecked[0].done()):
        unchecked.popleft().result()

    @functools.wraps(fn)
    def call(*args, **kwargs):
      raise_failures(block=False)
      future = executor.submit(fn, *args, **kwargs)
      unchecked.append(future)
      return future

    call.wait = functools.partial(raise_failures, block=True)
    return call

  return decorator


def _growth_steps(ratios: Sequence[float]):
  """Yields 1, 2, 5, 10, 20, 50, ... for ratios (1, 2, 5), increasing forever."""
  for exponent in range(64):
    for ratio in sorted(ratios):
      yield math.ceil(ratio * 10**exponent)


class PeriodicAction:
  """Calls `fn(t, step, scalars)` every `interval` seconds or steps.

  Args:
    fn: the action; with `run_async` it runs on a background thread.
    interval_type: "secs" or "steps".
    interval: the period; None never triggers by interval.
    start_time, start_step: when the action last ran (restored runs pass the
      checkpointed values so intervals continue rather than restart).
    run_async: run `fn` on a background thread, one call at a time, in order.
    log_all_data: keep every step's scalars and pass each one (in step order)
      to `fn` when the action next runs, instead of only the latest.
    logging_growth_ratios: also run at the steps of this growth schedule.
    run_on_final_step: `finish()` runs the action for the last step it saw
      if that step was not acted on (logging wants this; checkpointing, which
      saves at the end anyway, does not).
    first_device_only: with `run_async`, copy to the host only the first
      local device's copy of per-device and replicated arrays
      (`devices.stage_first_shards_read`): all that logging reads.
  """

  def __init__(self,
               fn: Callable[[float, int, Any], None],
               interval_type: str,
               interval: Optional[float],
               start_time: float = 0.0,
               start_step: int = 0,
               run_async: bool = True,
               log_all_data: bool = False,
               logging_growth_ratios: Optional[Sequence[float]] = None,
               run_on_final_step: bool = True,
               first_device_only: bool = False):
    if interval_type not in ("secs", "steps"):
      raise ValueError(f"interval_type={interval_type!r} must be 'secs' or 'steps'")
    self._fn = fn
    self._by_steps = interval_type == "steps"
    self._interval = interval
    self._prev_time = start_time
    self._prev_step = start_step
    self._log_all_data = log_all_data
    self._pending: list[tuple[int, Any]] = []
    self._run_on_final_step = run_on_final_step
    self._first_device_only = first_device_only
    self._last_call: Optional[tuple[float, int, Any]] = None
    self._last_acted_step: Optional[int] = None
    self._growth = iter(_growth_steps(logging_growth_ratios)) if logging_growth_ratios else None
    self._next_growth_step = self._advance_growth(start_step)
    self._executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=f"periodic_{getattr(fn, '__name__', 'action')}") \
        if run_async else None
    self._in_progress: Optional[concurrent.futures.Future] = None
    self._queued: list[tuple[float, int, Any]] = []
    self._last_submit_time = -math.inf

  def _advance_growth(self, step: int) -> Optional[int]:
    if self._growth is None:
      return None
    for growth_step in self._growth:
      if growth_step > step:
        return growth_step
    return None

  def _is_due(self, t: float, step: int) -> bool:
    if self._next_growth_step is not None and step >= self._next_growth_step:
      self._next_growth_step = self._advance_growth(step)
      return True
    if self._interval is None:
      return False
    if self._by_steps:
      return step - self._prev_step >= self._interval
    return t - self._prev_time >= self._interval

  def __call__(self, t: float, step: int, scalars: Any) -> None:
    self._last_call = (t, step, scalars)
    if self._log_all_data:
      self._pending.append((step, scalars))
    if self._is_due(t, step):
      self._act(t, step, scalars)
    elif self._queued:
      self._submit_if_idle(t)

  def _act(self, t: float, step: int, scalars: Any) -> None:
    batch = self._pending if self._log_all_data else [(step, scalars)]
    self._pending = []
    self._prev_time, self._prev_step, self._last_acted_step = t, step, step
    items = [(t, batch_step, batch_scalars) for batch_step, batch_scalars in batch]
    if self._executor is None:
      self._run_items(items)
      return
    self._queued.extend(items)
    self._submit_if_idle(t)

  def _submit_if_idle(self, t: Optional[float] = None) -> None:
    """Hands the queued steps to the background thread unless it is busy or,
    when the loop's time `t` is given, was handed some less than
    `_BATCH_SECONDS` before."""
    if t is not None and t - self._last_submit_time < _BATCH_SECONDS:
      return
    if self._in_progress is not None:
      if not self._in_progress.done():
        return
      finished, self._in_progress = self._in_progress, None
      finished.result()  # Raises what the previous batch raised.
    if self._queued:
      items, self._queued = self._queued, []
      self._last_submit_time = -math.inf if t is None else t
      scalars = [item[2] for item in items]
      # Any device work of the read is dispatched here, on the loop's thread;
      # the background thread only transfers (see `experiment.steps_in_flight_limit`).
      read = (devices.stage_first_shards_read(scalars) if self._first_device_only
              else functools.partial(jax.device_get, scalars))
      self._in_progress = self._executor.submit(self._run_items, items, read)

  def _run_items(self, items: list[tuple[float, int, Any]],
                 read: Optional[Callable[[], list[Any]]] = None) -> None:
    """Calls `fn` for each item, with the scalars `read()` returns if given."""
    scalars = read() if read is not None else [item[2] for item in items]
    for (t, step, _), host_scalars in zip(items, scalars):
      self._fn(t, step, host_scalars)

  def update_time(self, t: float, step: int) -> None:
    """Restarts the interval from `(t, step)`, e.g. after a restore."""
    self._prev_time, self._prev_step = t, step
    self._next_growth_step = self._advance_growth(step)

  @property
  def last_acted(self) -> tuple[float, int]:
    """`(time, step)` the action last ran at: what a resumed run continues from."""
    return self._prev_time, self._prev_step

  def finish(self) -> None:
    """Acts on the last step seen if due (see `run_on_final_step`), then waits."""
    if (self._run_on_final_step and self._last_call is not None
        and self._last_call[1] != self._last_acted_step):
      self._act(*self._last_call)
    self.wait_to_finish()

  def wait_to_finish(self) -> None:
    """Blocks until every due step has been acted on; raises the first error."""
    while self._in_progress is not None or self._queued:
      if self._in_progress is not None:
        finished, self._in_progress = self._in_progress, None
        finished.result()
      self._submit_if_idle()
