"""Periodic actions (logging, writing, checkpointing) run between training steps.

`PeriodicAction` keeps jaxline's contract, including its overridable
`_apply_condition(t, step)` and `_apply_fn(step, steps_per_sec, scalars)`.
With `run_async` at most `_MOST_BEHIND` due steps wait for the background
thread: a writer slower than training slows training instead of growing
memory without bound and holding up the save at a stop.
"""

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxline_ng import background

# How many due steps may wait for the background thread before the loop waits.
_MOST_BEHIND = 1000


def make_async(thread_name_prefix: str = ""):
  """Decorator: calls run on one background thread, in call order (a `background.Worker`).

  Each call returns a `concurrent.futures.Future`. Once a call has raised, the
  function never runs again, and every later call (and `wait()`) raises the error.
  """

  def decorator(fn):
    worker = background.Worker(thread_name_prefix or getattr(fn, "__name__", "async"))

    @functools.wraps(fn)
    def call(*args, **kwargs):
      return worker.submit(fn, *args, **kwargs)

    call.wait = worker.wait
    call.raise_if_failed = worker.raise_if_failed
    return call

  return decorator


def _on_growth_schedule(step: int, ratios: Sequence[float]) -> bool:
  """Whether `step` is `round(ratio * 10**k)` for one of `ratios`, with
  `10**k <= step < 10**(k + 1)`: ratios (1, 2, 5) give 1, 2, 5, 10, 20, 50, ..."""
  if step < 1:
    return False
  scale = 10 ** (len(str(int(step))) - 1)
  return any(step == round(ratio * scale) for ratio in ratios)


class EveryStepAction:
  """Base of the loop's own every-step actions (the guard, the stop check): the
  other `PeriodicAction` methods, which jaxline-style `train_loop`s call, do nothing."""

  def finish(self) -> None:
    pass

  def wait_to_finish(self) -> None:
    pass

  def update_time(self, t: float, step: int) -> None:
    del t, step


class PeriodicAction:
  """Calls `fn(step, scalars)` every `interval` seconds or steps (jaxline's class).

  Args:
    fn: the action, called with the step (steps completed) and that step's
      scalars on the host, `steps_per_sec` added (since the last action).
    interval_type: "secs" or "steps".
    interval: the period; with "steps" the action runs at its multiples.
      None (or 0 steps) never triggers by interval.
    start_time, start_step: when the action last ran; seconds and
      `steps_per_sec` are measured from there (see `update_time`). A
      `start_time` of None: a "secs" action is due at its first call, whose
      `steps_per_sec` is measured from when the action was made.
    run_async: run `fn` on a background thread, one call at a time, in order;
      an error it raises is raised by a later call of the action.
    log_all_data: pass `fn` every step's scalars since the last action, each
      with its own step, in order, not only the due step's.
    logging_growth_ratios: with "steps", also act at the steps of this growth
      schedule (ratios (1, 2, 5): steps 1, 2, 5, 10, 20, 50, 100, ...).
    end_step_to_action: a step the action always acts at (the last one).
  """

  def __init__(self,
               fn: Callable[[int, Any], None],
               interval_type: str,
               interval: float | None,
               start_time: float | None = 0.0,
               start_step: int = 0,
               run_async: bool = True,
               log_all_data: bool = False,
               logging_growth_ratios: Sequence[float] | None = None,
               end_step_to_action: int | None = None):
    if interval_type not in ("secs", "steps"):
      raise ValueError(f"interval_type={interval_type!r} must be 'secs' or 'steps'")
    if logging_growth_ratios and interval_type != "steps":
      raise ValueError("logging_growth_ratios apply to interval_type='steps' only")
    self._fn = fn
    self._by_steps = interval_type == "steps"
    self._interval = interval
    self._made_at = time.time()
    self._prev_time = start_time
    self._prev_step = start_step
    self.log_all_data = log_all_data  # jaxline's public attribute
    self._growth_ratios = tuple(logging_growth_ratios or ())
    self._end_step = end_step_to_action
    self._unlogged: list[tuple[int, Any]] = []  # With log_all_data: steps since the last action.
    self._last_seen: tuple[float, int, Any] | None = None
    self._last_acted_step: int | None = None
    self._worker = (background.Worker(f"periodic_{getattr(fn, '__name__', 'action')}",
                                      max_pending=_MOST_BEHIND) if run_async else None)

  def _apply_condition(self, t: float, step: int) -> bool:
    """Whether the action is due at `step`, completed at time `t` (jaxline's hook)."""
    if self._end_step is not None and step == self._end_step:
      return True
    if self._by_steps:
      if self._growth_ratios and _on_growth_schedule(step, self._growth_ratios):
        return True
      return bool(self._interval) and step % self._interval == 0
    return self._interval is not None and (
        self._prev_time is None or t - self._prev_time >= self._interval)

  def __call__(self, t: float, step: int, scalar_outputs: Any) -> None:
    # `scalar_outputs`: jaxline's name, for callers that pass it by keyword.
    if self._worker is not None:
      self._worker.raise_if_failed()  # Now, not at the next due step.
    self._last_seen = (t, step, scalar_outputs)
    if self.log_all_data:
      self._unlogged.append((step, scalar_outputs))
    if self._apply_condition(t, step):
      self._act(t, step, scalar_outputs)
    elif self.log_all_data and len(self._unlogged) >= _MOST_BEHIND:
      # Handed over early, so they count towards the backlog's bound.
      self._hand_over([(s, None, values) for s, values in self._unlogged])
      self._unlogged = []

  def _act(self, t: float, step: int, scalars: Any) -> None:
    elapsed = t - (self._made_at if self._prev_time is None else self._prev_time)
    steps_per_sec = (step - self._prev_step) / elapsed if elapsed > 0 else None
    batch = self._unlogged if self.log_all_data else [(step, scalars)]
    self._unlogged = []
    due = [(s, steps_per_sec if s == step else None, values) for s, values in batch]
    self._last_acted_step = step
    self.update_time(t, step)
    self._hand_over(due)

  def _hand_over(self, due: list[tuple[int, float | None, Any]]) -> None:
    """Acts on `due` now, or on the background thread one call per step (the bound counts steps)."""
    if self._worker is None:
      self._act_on(due)
      return
    for one in due:
      self._worker.submit(self._act_on, [one])

  def _to_host(self, scalars: list[Any]) -> list[Any]:
    """The due steps' scalars, in order, copied to the host whole."""
    return jax.device_get(scalars)

  def _act_on(self, due: list[tuple[int, float | None, Any]]) -> None:
    """Copies the due steps' scalars to the host and calls `fn` for each."""
    host_values = self._to_host([values for _, _, values in due])
    for (step, steps_per_sec, _), values in zip(due, host_values):
      self._apply_fn(step, steps_per_sec, values)

  def _apply_fn(self, step: int, steps_per_sec: float | None, scalars: Any) -> None:
    """Acts on one due step, its scalars on the host (jaxline's hook)."""
    if steps_per_sec is not None and isinstance(scalars, dict):
      scalars["steps_per_sec"] = steps_per_sec
    self._fn(step, scalars)

  def update_time(self, t: float, step: int) -> None:
    """Measures the next interval (seconds) and `steps_per_sec` from `(t, step)`."""
    self._prev_time, self._prev_step = t, step

  @property
  def last_acted(self) -> tuple[float, int]:
    """`(time, step)` the action last ran at: what a resumed run continues from."""
    return self._prev_time, self._prev_step

  def finish(self) -> None:
    """Acts on the last step seen unless it already did, then waits for it."""
    if self._last_seen is not None and self._last_seen[1] != self._last_acted_step:
      self._act(*self._last_seen)
    self.wait_to_finish()

  def wait_to_finish(self) -> None:
    """Blocks until every due step has been acted on; raises the first error."""
    if self._worker is not None:
      self._worker.wait()
