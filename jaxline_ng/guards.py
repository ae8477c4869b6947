"""Run safety: a guard against non-finite training scalars.

`config.non_finite_policy` chooses what happens when a scalar returned by
`step` is NaN or infinite:

- "halt" (default): training stops with `NonFiniteError` naming the first bad
  step and its bad scalars, and nothing after the last good step is saved,
  so `latest` stays the last finite state;
- "warn": the same message is logged once per bad step and training goes on;
- "off": no checking.

The guard adds no host synchronisation per step: it keeps a reference to each
step's scalars (which stay on device) and reads all pending ones in a single
transfer on a background thread when they are logged anyway or when
`MAX_PENDING` have piled up, and synchronously right before a checkpoint is
saved (which waits for the state anyway). Reading every step, not only the
logged ones, is what lets it name the first bad step.
"""

import math
import threading
from typing import Any, Mapping

import jax
import numpy as np
from absl import logging

from jaxline_ng import periodic

POLICIES = ("halt", "warn", "off")
# Steps whose scalars may wait to be read; bounds the references held.
MAX_PENDING = 1000


class NonFiniteError(FloatingPointError):
  """A training scalar was NaN or infinite (policy "halt")."""


def non_finite_names(scalars: Mapping[str, Any]) -> list[str]:
  """The names of host scalars that are NaN or infinite, sorted."""
  bad = []
  for name, value in scalars.items():
    array = np.asarray(value)
    if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all():
      bad.append(name)
  return sorted(bad)


class NonFiniteGuard:
  """Collects each step's scalars and checks them in batches.

  Call it after every step (as a periodic action); `check()` reads what has
  accumulated. Safe to call from the loop thread and a logging thread.
  """

  def __init__(self, policy: str):
    self._policy = policy
    self._pending: list[tuple[int, Any]] = []
    self._pending_lock = threading.Lock()  # Uncontended per step: ~0.1 us.
    self._check_lock = threading.Lock()
    self._failure: NonFiniteError | None = None
    self.check_in_background = periodic.make_async("non_finite_guard")(self.check)

  def __call__(self, t: float, step: int, scalars: Any) -> None:
    if self._failure is not None:
      raise self._failure
    if self._policy != "off" and scalars:
      with self._pending_lock:
        self._pending.append((step, scalars))
        backlog = len(self._pending)
      if backlog == MAX_PENDING:
        self.check_in_background()

  def check(self) -> None:
    """Reads pending scalars; raises (halt) or logs (warn) on the first bad step."""
    with self._check_lock:
      if self._failure is not None:
        raise self._failure
      with self._pending_lock:
        pending, self._pending = self._pending, []
      if not pending:
        return
      fetched = jax.device_get([dict(scalars) for _, scalars in pending])
      for (step, _), values in zip(pending, fetched):
        bad = non_finite_names(values)
        if not bad:
          continue
        # `step` counts steps completed, so the step that produced it saw step - 1.
        message = (f"non-finite training scalars {', '.join(bad)} at step {step} "
                   f"(the step called with global_step={step - 1})")
        if self._policy == "warn":
          logging.warning("[jaxline_ng] %s; continuing (non_finite_policy='warn').", message)
          continue
        self._failure = NonFiniteError(
            f"{message}; stopped without saving it (non_finite_policy='halt')")
        raise self._failure

  def finish(self) -> None:
    self.check()

  def wait_to_finish(self) -> None:
    pass


def is_finite_number(value: Any) -> bool:
  try:
    return math.isfinite(float(value))
  except (TypeError, ValueError):
    return False
