"""A watchdog for stuck training: a run whose steps stop finishing ends, saying where.

When no step (saves included) has finished for `config.step_timeout_secs`,
`StepWatchdog` logs the step and every thread's stack and exits `EXIT_STUCK`;
in a multi-process run the first to fire tells the others.
"""

import faulthandler
import sys
import threading
import time

from absl import logging

from jaxline_ng import agreement, distributed, periodic

# What the process exits with when the watchdog fires.
EXIT_STUCK = 1
# The automatic timeout: this many times the slowest step so far (the first
# one compiles), and never less than the floor.
SLOWEST_STEP_FACTOR = 20
FLOOR_SECS = 600.0
# Before the first step has finished, compiling a large model can take long.
FIRST_STEP_SECS = 3600.0


def describe(timeout_secs: float | None) -> str:
  """How `config.step_timeout_secs` reads in log lines."""
  if timeout_secs is None:
    return (f"automatic: {SLOWEST_STEP_FACTOR} x the slowest step, at least {FLOOR_SECS:g} s "
            f"({FIRST_STEP_SECS:g} s for the first)")
  return f"{timeout_secs:g} s"


class StepWatchdog(periodic.EveryStepAction):
  """Ends the process when no training step has finished for too long.

  Args:
    timeout_secs: seconds without a finished step before the process ends;
      None for the automatic timeout (see the module), 0 for no watchdog.
    start_step: the step the run starts from, named if the first step hangs.
  """

  def __init__(self, timeout_secs: float | None, start_step: int):
    self._timeout_secs = timeout_secs
    self._step = start_step
    self._last = time.monotonic()
    self._slowest: float | None = None
    self._closed = threading.Event()
    self._thread = None
    if timeout_secs != 0:
      self._thread = threading.Thread(target=self._watch, name="jaxline_ng_watchdog", daemon=True)
      self._thread.start()

  def __call__(self, t: float, step: int, scalars) -> None:
    del t, scalars
    now = time.monotonic()
    self._slowest = max(self._slowest or 0.0, now - self._last)
    self._last, self._step = now, step

  def _timeout(self) -> float:
    if self._timeout_secs is not None:
      return self._timeout_secs
    if self._slowest is None:
      return FIRST_STEP_SECS
    return max(FLOOR_SECS, SLOWEST_STEP_FACTOR * self._slowest)

  def _watch(self) -> None:
    while True:
      waited = time.monotonic() - self._last
      timeout = self._timeout()
      if waited >= timeout:
        self._fire(waited)
      if self._closed.wait(min(timeout - waited, 60.0)):
        return

  def _fire(self, waited: float) -> None:
    message = (f"no training step has finished for {waited:.0f} s (config.step_timeout_secs: "
               f"{describe(self._timeout_secs)}); the run is stuck after step {self._step}")
    logging.error("[jaxline_ng] %s. Every thread's stack follows; exiting with code %d.",
                  message, EXIT_STUCK)
    logging.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    if distributed.is_multiprocess():
      # The store may be as stuck as the step: the exit does not wait long for it.
      telling = threading.Thread(target=agreement.publish_failure, args=(message, EXIT_STUCK),
                                 daemon=True)
      telling.start()
      telling.join(timeout=5)
    print(f"jaxline_ng: error: {message}", file=sys.stderr, flush=True)
    # Not a plain exit: process 0 hosts JAX's coordination service, and the
    # others must hear of the failure before it goes (see exit_after_failure).
    agreement.exit_after_failure(EXIT_STUCK)

  def close(self) -> None:
    """Stops watching: the run has ended, however it ended."""
    self._closed.set()
