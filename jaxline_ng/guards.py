"""Run safety: a guard against non-finite training scalars (`config.non_finite_policy`:
"halt" stops naming the first bad step and saves nothing after the last good one,
"warn" logs it and goes on, "off").

The guard costs a deque append per step, no device work: it reads what logging
reads (`observe`) and the newest step's scalars before each save (`seal`), and
keeps each step's scalars since the last finite check to name the first bad
one. A value neither read (gone by the next check) is not reported.
"""

import collections
import itertools
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from jaxline_ng import agreement, devices, errors, periodic

POLICIES = ("halt", "warn", "off")
# Steps whose scalars may wait for a check; past this, the loop reads the
# newest step's scalars itself (one read per this many steps).
MAX_UNCHECKED = 1000
# Under "warn", the first this many non-finite steps are each logged.
_WARN_EACH = 10
# How long a failing process may take to leave its last verdict.
_LAST_VERDICT_SECS = 5.0


class NonFiniteError(FloatingPointError, errors.OneLineError):
  """A training scalar was NaN or infinite (policy "halt")."""


def non_finite_names(scalars: Mapping[str, Any]) -> list[str]:
  """The names of host scalars that are NaN or infinite, sorted."""
  bad = []
  for name, value in scalars.items():
    # Python numbers (what logging reads) skip NumPy, which would cost more
    # than the check itself, for every value of every logged step.
    if type(value) is float:
      if not math.isfinite(value):
        bad.append(name)
      continue
    if type(value) in (int, bool):
      continue
    array = np.asarray(value)
    if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all():
      bad.append(name)
  return sorted(bad)


class NonFiniteGuard(periodic.EveryStepAction):
  """Keeps each step's scalars until a check, and finds the first bad step.

  Call it after every step and `seal` on the loop's thread; `observe` and what
  `seal` returns may run on any thread. `start_step`: the step resumed from.
  """

  def __init__(self, policy: str, start_step: int = 0):
    self._policy = policy
    self._unchecked: collections.deque[tuple[int, Any]] = collections.deque()
    self._lock = threading.Lock()
    # The earliest step an observer saw non-finite, and its names, until the loop reports it.
    self._bad_seen: tuple[int, list[str]] | None = None
    self._failure: NonFiniteError | None = None
    self._failed_step: int | None = None
    self._newest_step = start_step  # A rerun of a finished run's final save awaits a verdict.
    # Checks covering the same steps may report at once: each step is examined once.
    self._report_lock = threading.Lock()
    self._reported_through = -1
    self._warned = 0  # Non-finite steps reported under "warn".

  def __call__(self, t: float, step: int, scalars: Any) -> None:
    self._newest_step = step
    if self._failure is not None:
      raise self._failure
    if self._policy == "off" or not scalars:
      return
    with self._lock:
      self._unchecked.append((step, scalars))
      backlog = len(self._unchecked)
    if self._bad_seen is not None:
      self._find_first_bad()
    elif backlog >= MAX_UNCHECKED:
      self.check()

  def observe(self, step: int, host_scalars: Mapping[str, Any]) -> None:
    """Takes scalars of `step` that were copied to the host anyway (for logging)."""
    if self._policy == "off":
      return
    bad = non_finite_names(host_scalars)
    if not bad:
      self._forget_up_to(step)
      return
    with self._lock:  # The loop's thread looks for the first bad step.
      if self._bad_seen is None or step < self._bad_seen[0]:
        self._bad_seen = (step, bad)

  def seal(self, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A check of every step so far, to run before saving them (on any thread).

    It reads the newest step's scalars (waiting for that step) and, if one is
    not finite, the earlier ones to name the first; it raises `NonFiniteError`
    under "halt". Later steps never affect it. If it passes, it runs `then`
    (the other processes' checks), which may veto the save by raising.
    """
    if self._bad_seen is not None:  # Logging saw one since the loop last looked.
      self._find_first_bad()
    with self._lock:
      steps = list(self._unchecked)

    def sealed_check():
      self._check_sealed(steps)
      if then is not None:
        then()

    return sealed_check

  @property
  def newest_step(self) -> int:
    """The step the loop completed last (`start_step` before the first)."""
    return self._newest_step

  def verdict_through(self, step: int, give_up: Callable[[], bool]) -> str:
    """Checks every step up to `step` once the loop has run it (from `PeerChecks`'
    thread): "ok", why not (the loop raises it too), or "stopped" once `give_up()`."""
    if agreement.wait_for(lambda: self._newest_step >= step or None, give_up) is None:
      return "stopped"
    with self._lock:
      steps = [entry for entry in self._unchecked if entry[0] <= step]
    try:
      self._check_sealed(steps)
    except NonFiniteError as e:
      return str(e)
    return "ok"

  def check(self) -> None:
    """Checks every step so far; raises (halt) or logs (warn) on the first bad one."""
    self.seal()()

  def _check_sealed(self, steps: list[tuple[int, Any]]) -> None:
    # A save sealed before the bad step was found is judged on its own steps.
    if self._failure is not None and (not steps or steps[-1][0] >= self._failed_step):
      raise self._failure
    if self._policy == "off" or not steps:
      return
    newest_step, newest = steps[-1]
    if non_finite_names(devices.first_copy_to_host(dict(newest))):
      self._report_first_bad(steps)
    else:
      self._forget_up_to(newest_step)

  def _forget_up_to(self, step: int) -> None:
    with self._lock:
      if self._bad_seen is not None:  # Kept for the loop's report of the first bad step.
        step = min(step, self._bad_seen[0] - 1)
      while self._unchecked and self._unchecked[0][0] <= step:
        self._unchecked.popleft()

  def _find_first_bad(self) -> None:
    """Reports the first bad step up to the one logging saw (on the loop's thread)."""
    with self._lock:
      seen_at, seen_bad = self._bad_seen
      self._bad_seen = None
      steps = [entry for entry in self._unchecked if entry[0] <= seen_at]
    self._report_first_bad(steps)
    with self._report_lock:
      if seen_at > self._reported_through:  # A save's check forgot it: logging read it.
        self._reported_through = seen_at
        self._report(seen_at, seen_bad)

  def _report_first_bad(self, steps: list[tuple[int, Any]]) -> None:
    """Reads `steps` in order; reports the first non-finite one (warn: each, once)."""
    with self._report_lock:
      for step, scalars in steps:
        if step <= self._reported_through:
          continue
        bad = non_finite_names(jax.device_get(dict(scalars)))  # Every device's copy.
        if bad:
          self._report(step, bad)
      if steps:
        self._reported_through = max(self._reported_through, steps[-1][0])
    self._forget_up_to(steps[-1][0] if steps else -1)

  def _report(self, step: int, bad: list[str]) -> None:
    """Logs ("warn") or raises ("halt") that scalars `bad` of `step` are not finite."""
    # `step` counts steps completed, so the step that produced it saw step - 1.
    message = (f"non-finite training scalars {', '.join(bad)} at step {step} "
               f"(the step called with global_step={step - 1})")
    if self._policy == "warn":
      # Each of the first few, then at 100, 1000, ... of them: a run that stays
      # non-finite would otherwise log a line at every step.
      self._warned += 1
      if self._warned <= _WARN_EACH or str(self._warned).rstrip("0") == "1":
        logging.warning("[jaxline_ng] %s; continuing (non_finite_policy='warn'; non-finite "
                        "step %d of the run%s).", message, self._warned,
                        "" if self._warned < _WARN_EACH else ", the next reported at the "
                        f"{10 ** len(str(self._warned))}th")
      return
    self._failed_step = step
    self._failure = NonFiniteError(
        f"{message}; stopped without saving it (non_finite_policy='halt')")
    raise self._failure

  def finish(self) -> None:
    self.check()


class PeerFailedError(RuntimeError):
  """Another process of the run failed or found a non-finite value: the save is not kept."""


class PeerChecks:
  """Multi-process runs: the chief saves a step once every process has checked it
  (a per-process value can be non-finite in one process only).

  The chief's n-th save announces its step s ("save/n") and waits on its training
  thread for each other process's verdict ("verdict/n") on its steps up to s,
  given from a thread of their own (`answer`). Anything but "ok" vetoes the save.
  """

  def __init__(self, guard: NonFiniteGuard):
    self._guard = guard
    self._saves = 0
    self._closed = threading.Event()
    self._answering: threading.Thread | None = None

  def before_save(self, step: int) -> Callable[[], None]:
    """The chief's wait for every other process's verdict on `step`, to run before writing it."""

    def agree():
      index = self._saves  # Saves are checked in order, on one worker.
      self._saves += 1
      agreement.exchange(f"save/{index}", str(step), read_from=())
      for process in range(jax.process_count()):
        if process == jax.process_index():
          continue
        verdicts = agreement.exchange(f"verdict/{index}", None, read_from=[process])
        verdict = verdicts[0] if verdicts else self._last_verdict(process, step)
        if verdict != "ok":
          logging.warning("[jaxline_ng] Not saving step %d: process %d: %s", step, process, verdict)
          raise PeerFailedError(f"process {process}: {verdict}")

    return agree

  @staticmethod
  def _last_verdict(process: int, step: int) -> str:
    """`process`'s verdict on `step` left by `answer_before_failing` if it
    covers it, else the failure a process published."""
    left = agreement.exchange("last_verdict", None, read_from=[process], give_up=lambda: True)
    if left is not None:
      through, verdict = left[0].split(" ", 1)
      if int(through) >= step:
        return verdict
    return agreement.published_failure().split(" ", 2)[2]

  def answer_before_failing(self) -> None:
    """Leaves this process's verdict on the steps it completed before it fails: an
    error at step 12 says nothing against the save of step 10 announced just before."""
    step = self._guard.newest_step

    def leave():
      try:
        verdict = self._guard.verdict_through(step, give_up=lambda: True)
        agreement.exchange("last_verdict", f"{step} {verdict}", read_from=())
      except Exception:  # pylint: disable=broad-except  (the failure itself is the news)
        logging.exception("[jaxline_ng] Could not leave a verdict on step %d:", step)

    # Bounded: reading the scalars waits for collectives a gone peer never finishes.
    leaving = threading.Thread(target=leave, name="jaxline_ng_last_verdict", daemon=True)
    leaving.start()
    leaving.join(timeout=_LAST_VERDICT_SECS)

  def answer(self) -> None:
    """Starts answering the chief's saves with this process's verdicts (non-chief processes)."""

    def serve():
      for index in itertools.count():
        announced = agreement.exchange(f"save/{index}", None, read_from=[0],
                                       give_up=self._closed.is_set)
        if announced is None:
          return
        verdict = self._guard.verdict_through(int(announced[0]), give_up=self._closed.is_set)
        agreement.exchange(f"verdict/{index}", verdict, read_from=())

    self._answering = threading.Thread(target=serve, name="jaxline_ng_peer_checks", daemon=True)
    self._answering.start()

  def close(self) -> None:
    """Stops answering (after the chief's last save); returns once the thread ended."""
    self._closed.set()
    if self._answering is not None:
      self._answering.join()
