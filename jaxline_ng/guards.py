"""Run safety: a guard against non-finite training scalars.

`config.non_finite_policy` chooses what happens when a scalar returned by
`step` is NaN or infinite:

- "halt" (default): training stops with `NonFiniteError` naming the first bad
  step and its bad scalars, and nothing after the last good step is saved,
  so `latest` stays the last finite state;
- "warn": the same message is logged once per bad step and training goes on;
- "off": no checking.

The guard adds no host synchronisation per step and little work to the
loop's thread: it keeps a reference to each step's scalars (which stay on
device); every `BATCH` steps it dispatches one reduction of those steps'
scalars to one flag per step, and its own thread reads the flags (one small
transfer per batch) once those steps have run. A failure found there is
raised on the loop's thread by the guard's next call. `seal()` hands over
the steps not yet in a batch, and every save is validated with it. Checking
every step, not only the logged ones, is what lets it name the first bad
step; every device's copy of a per-device scalar is checked.
"""

import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxline_ng import periodic

POLICIES = ("halt", "warn", "off")
# Steps reduced on device together: one dispatch and one flag array per batch.
BATCH = 32


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


@jax.jit
def _finite_rows(rows):
  """For each row (one step's floating-point arrays), whether all are finite."""
  return jnp.stack([jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in row]))
                    if row else jnp.bool_(True) for row in rows])


@functools.cache
def _is_inexact(dtype) -> bool:
  return bool(jnp.issubdtype(dtype, jnp.inexact))


class _Batch:
  """Up to `BATCH` steps' scalars, checked together.

  Made on the loop's thread, which also dispatches the on-device reduction:
  a dispatch from the thread that runs the steps keeps the order of device
  work the same on every process. `bad_steps` reads the result, on any thread.
  """

  def __init__(self, entries: list[tuple[int, Any]], treedef):
    self.entries = entries
    self._flags = None  # Device bool[BATCH]: False where a step's arrays are not finite.
    rows, self._host_values = [], []
    for _, scalars in entries:
      leaves, step_treedef = jax.tree.flatten(scalars)
      if step_treedef != treedef:
        return  # Scalars that change shape from step to step are read on the host.
      rows.append([x for x in leaves if isinstance(x, jax.Array) and _is_inexact(x.dtype)])
      self._host_values.append([x for x in leaves if not isinstance(x, jax.Array)])
    # A fixed number of rows keeps the reduction to one compilation: a
    # partial batch repeats its last row.
    rows += [rows[-1]] * (BATCH - len(rows))
    try:
      self._flags = _finite_rows(rows)
    except ValueError:  # Arrays on different devices: read them on the host.
      self._host_values = []

  def bad_steps(self) -> list[tuple[int, Any]]:
    """The entries with a non-finite scalar; waits for their steps to run."""
    if self._flags is None:
      values = jax.device_get([dict(scalars) for _, scalars in self.entries])
      return [entry for entry, host in zip(self.entries, values) if non_finite_names(host)]
    flags = np.asarray(self._flags)
    return [entry for entry, ok, host in zip(self.entries, flags, self._host_values)
            if not ok or non_finite_names(dict(enumerate(host)))]


class NonFiniteGuard:
  """Collects each step's scalars and checks them in batches.

  Call it after every step (as a periodic action), and `seal`, on the loop's
  thread; what `seal` returns may run on any thread.
  """

  def __init__(self, policy: str):
    self._policy = policy
    self._filling: list[tuple[int, Any]] = []
    self._treedef = None  # Of the first step's scalars.
    self._submitted = None  # (future, last step) of the newest batch handed over.
    self._failure: NonFiniteError | None = None
    self._failure_step = None
    self._check_in_background = periodic.make_async("non_finite_guard")(self._check)

  def __call__(self, t: float, step: int, scalars: Any) -> None:
    if self._failure is not None:
      raise self._failure
    if self._policy == "off" or not scalars:
      return
    if self._treedef is None:
      self._treedef = jax.tree.structure(scalars)
    self._filling.append((step, scalars))
    if len(self._filling) == BATCH:
      self._submit()

  def _submit(self) -> None:
    batch, self._filling = _Batch(self._filling, self._treedef), []
    self._submitted = (self._check_in_background(batch), batch.entries[-1][0])

  def seal(self) -> Callable[[], None]:
    """Hands over every step so far; returns a check of exactly those steps.

    The check waits for them to be read and raises `NonFiniteError` (policy
    "halt") if one was not finite. A save validated with it is never vetoed
    by a later step.
    """
    if self._filling:
      self._submit()
    submitted = self._submitted

    def check_sealed_steps() -> None:
      if submitted is None:
        return
      future, last_step = submitted
      future.result()  # Batches run in order: every sealed step has been read.
      if self._failure is not None and self._failure_step <= last_step:
        raise self._failure

    return check_sealed_steps

  def check(self) -> None:
    """Checks every step so far; raises (halt) or logs (warn) on the first bad one."""
    self.seal()()

  def _check(self, batch: _Batch) -> None:
    if self._failure is not None:
      return
    for step, scalars in batch.bad_steps():
      self._report(step, jax.device_get(dict(scalars)))

  def _report(self, step: int, values: Mapping[str, Any]) -> None:
    bad = non_finite_names(values)
    # `step` counts steps completed, so the step that produced it saw step - 1.
    message = (f"non-finite training scalars {', '.join(bad)} at step {step} "
               f"(the step called with global_step={step - 1})")
    if self._policy == "warn":
      logging.warning("[jaxline_ng] %s; continuing (non_finite_policy='warn').", message)
      return
    self._failure_step = step
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
