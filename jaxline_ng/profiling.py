"""A JAX profiler trace of a chosen window of training steps.

`config.profile_steps = (first, stop)` traces steps first..stop-1 into
`<checkpoint_dir>/<mode>/profile` (TensorBoard's profile plugin, or Perfetto).
"""

import os
from typing import Any

import jax
from absl import logging

from jaxline_ng import periodic


class ProfileWindow(periodic.EveryStepAction):
  """Starts the trace before step `first` runs and stops it after step `stop - 1`
  (called after each step with the steps completed: the next step's `global_step`)."""

  def __init__(self, first: int, stop: int, logdir: str, steps_completed: int):
    self._first, self._stop, self._logdir = first, stop, logdir
    self._active = self._traced = False
    self._traced_from = self._start_step = self._steps_completed = steps_completed
    if first <= steps_completed < stop:
      self._start(steps_completed)

  def _start(self, step: int) -> None:
    os.makedirs(self._logdir, exist_ok=True)
    jax.profiler.start_trace(self._logdir)
    self._active = self._traced = True
    self._traced_from = step
    logging.info("[jaxline_ng] Profiling steps %d to %d into %s", step, self._stop - 1,
                 self._logdir)

  def _end(self, step: int, scalars: Any) -> None:
    jax.block_until_ready(scalars)  # The window's device work belongs in the trace.
    jax.profiler.stop_trace()
    self._active = False
    logging.info("[jaxline_ng] Profile of steps %d to %d written to %s "
                 "(tensorboard --logdir %s, Profile tab)",
                 self._traced_from, step - 1, self._logdir, self._logdir)

  def __call__(self, t: float, step: int, scalars: Any) -> None:
    self._steps_completed = step
    if self._active and step >= self._stop:
      self._end(step, scalars)
    elif not self._active and step == self._first:
      self._start(step)

  def finish(self) -> None:
    """Stops a trace the run ended inside of."""
    if self._active:
      jax.profiler.stop_trace()
      self._active = False
      logging.info("[jaxline_ng] Profile (cut short by the end of training) written to %s",
                   self._logdir)
    elif not self._traced:  # A window the run never reached, or resumed past.
      trained = (f"the steps this run trained, {self._start_step} to "
                 f"{self._steps_completed - 1}" if self._steps_completed > self._start_step
                 else f"this run, which trained no step (it began at {self._start_step})")
      logging.warning("[jaxline_ng] Nothing profiled: config.profile_steps=(%d, %d) is outside "
                      "%s.", self._first, self._stop, trained)
