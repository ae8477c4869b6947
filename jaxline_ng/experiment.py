"""AbstractExperiment: the class users subclass (and fork) to define a run.

The meaning is jaxline's: the platform constructs the experiment as
`cls(mode, init_rng=..., **config.experiment_kwargs)`, calls `step` once per
training step and `evaluate` once per checkpoint, both with the keyword
arguments `global_step`, `rng` and `writer`. `global_step` and `rng` carry a
leading axis of size `jax.local_device_count()`, ready to pass to a pmap; in
training, `global_step` is a host NumPy array (so `global_step[0]` is free, as
it was in jaxline), `rng` a device array.

State listed in `CHECKPOINT_ATTRS` (`{attribute: checkpoint name}`) is
pmap-replicated: one copy is checkpointed and it is restored replicated.
`NON_BROADCAST_CHECKPOINT_ATTRS` are stored and restored whole.
"""

import abc
import collections
import contextlib
import functools
import inspect
import math
import os
import threading
import time
from typing import Any, Mapping, Optional

import jax
from absl import logging

from jaxline_ng import devices
from jaxline_ng import mesh as mesh_lib
from jaxline_ng import rng as rng_lib

Scalars = Mapping[str, Any]


class AbstractExperiment(abc.ABC):
  """The interface between user code and the jaxline_ng loops."""

  CHECKPOINT_ATTRS: Mapping[str, str] = {}
  NON_BROADCAST_CHECKPOINT_ATTRS: Mapping[str, str] = {}

  def __init__(self, mode: str, init_rng: Optional[jax.Array] = None):
    """`init_rng` may be omitted by subclasses that call `super().__init__(mode=mode)`."""
    self.mode = mode
    self.init_rng = init_rng

  @abc.abstractmethod
  def step(self, *, global_step: jax.Array, rng: jax.Array, writer) -> Scalars:
    """Performs one training step and returns scalars to log.

    Declare only the keyword arguments you use, or take `**unused_kwargs`.
    """

  @abc.abstractmethod
  def evaluate(self, *, global_step: jax.Array, rng: jax.Array, writer) -> Optional[Scalars]:
    """Evaluates the current (restored) state and returns scalars."""

  def should_run_step(self, global_step: int, config) -> bool:
    """Whether the loop runs the step that has seen `global_step` steps before it.

    Override for epoch- or update-count termination (`training_steps=None`).
    The evaluation loop asks it too, to learn when training has ended.
    """
    return global_step < config.training_steps

  def initialize_train_step_rng(self, random_seed: int, state) -> jax.Array:
    """The per-device chain key the training loop starts from.

    Specialised per host/device by `config.random_mode_train`; differs from the
    `init_rng` key unless `config.legacy_random_seed_behavior`.
    """
    return rng_lib.seeded_run_keys(
        random_seed, state.config.random_mode_train,
        train_stream=not state.config.legacy_random_seed_behavior)

  def train_loop(self, config, state, periodic_actions, writer=None) -> None:
    """Runs training steps until `should_run_step` says stop.

    `state` is the checkpointed training state: `state.global_step` (host int,
    steps completed) and `state.train_step_rng` (per-device chain key) are
    advanced here, so a checkpoint taken by a periodic action always matches
    the step it was taken at.
    """
    step_inputs = rng_lib.StepInputs(state.global_step, state.train_step_rng)
    step = keyword_filtered(self.step)
    in_flight = StepsInFlight(steps_in_flight_limit(config))
    with log_activity("training loop"):
      while self.should_run_step(state.global_step, config):
        global_step_devices, step_rng, next_chain = step_inputs.next()
        with jax.profiler.StepTraceAnnotation("train", step_num=state.global_step):
          scalars = step(global_step=global_step_devices, rng=step_rng, writer=writer)
        in_flight.dispatched(scalars)
        state.global_step += 1
        state.train_step_rng = next_chain
        now = time.time()
        for action in periodic_actions:
          action(now, state.global_step, scalars)

  def snapshot_state(self) -> Mapping[str, Any]:
    """One copy of every checkpointed attribute, keyed by checkpoint name.

    In pmap mode CHECKPOINT_ATTRS are read from the first device; in mesh
    mode they are global arrays and taken whole. Either way the device
    arrays returned, NON_BROADCAST_CHECKPOINT_ATTRS' included, are fresh
    buffers (slices or copies), so the caller may keep them while training
    donates the live ones; an override should return fresh arrays too, or
    the checkpointer copies what it returns.
    """
    return self._snapshot(one_copy=devices.get_first)

  def _snapshot(self, one_copy) -> dict[str, Any]:
    """`snapshot_state`, taking pmap-mode CHECKPOINT_ATTRS with `one_copy`
    (of the dict `{checkpoint name: value}`, in one call)."""
    attrs, non_broadcast_attrs = checkpoint_attrs(self)
    if not attrs and not non_broadcast_attrs:
      logging.warning(
          "%s declares no CHECKPOINT_ATTRS or NON_BROADCAST_CHECKPOINT_ATTRS: "
          "checkpoints will hold no experiment state.", type(self).__name__)
    if mesh_lib.active_mesh() is not None:
      one_copy = devices.fresh_copies
    snapshot = dict(one_copy({name: getattr(self, attr) for attr, name in attrs.items()}))
    for attr, name in non_broadcast_attrs.items():
      # Host values pass through; device arrays are copied (no dispatch without any).
      snapshot[name] = devices.fresh_copies(getattr(self, attr))
    return snapshot

  def restore_from_snapshot(self, snapshot_state: Mapping[str, Any]) -> None:
    """Sets checkpointed attributes from a snapshot.

    pmap mode replicates CHECKPOINT_ATTRS over the local devices; mesh mode
    places them with the shardings the attributes have now (as `__init__`
    made them), so sharded parameters come back sharded the same way.
    """
    attrs, non_broadcast_attrs = checkpoint_attrs(self)
    for attr, name in attrs.items():
      if mesh_lib.active_mesh() is None:
        value = devices.bcast_local_devices(snapshot_state[name])
      else:
        value = mesh_lib.restore_like(getattr(self, attr, None), snapshot_state[name])
      setattr(self, attr, value)
    for attr, name in non_broadcast_attrs.items():
      setattr(self, attr, snapshot_state[name])

  def on_new_best_model(self, best_state) -> None:
    """Called after evaluation finds a new best metric, before `best` is saved.

    `best_state.global_step` and `best_state.best_eval_metric_value` describe it.
    """


# XLA's CPU client runs a multi-device dispatch as one task per device on its
# thread pool, and each task waits there while its device has 32 executions
# in flight. So every thread that dispatches can hold one pool thread per
# device, and the collective in progress needs one per device more: with D
# threads dispatching device computations, a pool of (D + 1) threads per
# device cannot deadlock. The training thread is one; another thread of the
# process that dispatches while it runs registers with
# `dispatching_beside_training`. jaxline_ng's own helper threads (logging,
# writing, saving) only transfer, never dispatch.
_other_dispatching_threads = 0
_dispatchers_lock = threading.Lock()


@contextlib.contextmanager
def dispatching_beside_training():
  """Declares, for its duration, one more thread dispatching device computations
  while a training loop runs in this process (enter it before the loop starts).

  `train_eval_multithreaded` declares its evaluator; declare a thread of
  your own that computes on the devices (an input pipeline running jitted
  code, say), so the automatic `max_steps_in_flight` leaves it room.
  """
  global _other_dispatching_threads
  with _dispatchers_lock:
    _other_dispatching_threads += 1
  try:
    yield
  finally:
    with _dispatchers_lock:
      _other_dispatching_threads -= 1


def cpu_pool_threads() -> int:
  """The size of XLA's CPU client thread pool, as XLA works it out.

  The larger of the local device count and `PJRT_NPROC`, else `NPROC`, else
  the CPUs this process may run on (XLA reads the variables when the
  backend starts; a value that is not an integer is skipped, as XLA does).
  """
  threads = None
  for name in ("PJRT_NPROC", "NPROC"):
    try:
      threads = max(0, int(os.environ[name]))
      break
    except (KeyError, ValueError):
      continue
  if threads is None:
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return max(threads or 0, jax.local_device_count())


def steps_in_flight_limit(config) -> int:
  """How many steps may be dispatched but unfinished; 0 for no limit.

  `config.max_steps_in_flight` (None: automatic). Automatic is 8 on a CPU
  backend with several local devices whose thread pool (`cpu_pool_threads`)
  has fewer than D + 1 threads per device, D being the threads dispatching
  device computations (the training thread and those declared with
  `dispatching_beside_training`), and unlimited elsewhere. With such a pool,
  a host ~32 steps ahead has its later dispatches hold the pool threads a
  device needs for the current step's collective, which deadlocks (XLA
  aborts after 40 s): on a 2-core machine the pool has one thread per
  device. Measurements in tests/README.md.
  """
  limit = getattr(config, "max_steps_in_flight", None)
  if limit is not None:
    return limit
  local_devices = jax.local_device_count()
  if jax.default_backend() != "cpu" or local_devices == 1:
    return 0
  with _dispatchers_lock:
    dispatching_threads = 1 + _other_dispatching_threads
  if cpu_pool_threads() >= (dispatching_threads + 1) * local_devices:
    return 0
  return 8


class StepsInFlight:
  """Keeps at most `limit` steps dispatched but unfinished.

  When a dispatch makes `limit` steps outstanding, it waits until only half
  of them are: one wait every `limit // 2` steps, like a hand-written loop
  that fetches a value now and then, rather than a wait (and a wake-up of
  this thread by a device thread) after every step. A step's outputs (what
  `step` returned) finish with it; a step that returns no device arrays is
  not held back.
  """

  def __init__(self, limit: int):
    self._limit = limit
    self._outputs: collections.deque = collections.deque()

  def dispatched(self, outputs) -> None:
    if not self._limit:
      return
    self._outputs.append(outputs)
    if len(self._outputs) >= self._limit:
      # Devices run steps in order: once this one is done, so are those before it.
      while len(self._outputs) > self._limit // 2:
        oldest = self._outputs.popleft()
      jax.block_until_ready(oldest)


def checkpoint_attrs(experiment) -> tuple[Mapping[str, str], Mapping[str, str]]:
  """The experiment's (CHECKPOINT_ATTRS, NON_BROADCAST_CHECKPOINT_ATTRS).

  Either may be a class attribute or an instance property, and None means {}.
  """
  return (getattr(experiment, "CHECKPOINT_ATTRS", None) or {},
          getattr(experiment, "NON_BROADCAST_CHECKPOINT_ATTRS", None) or {})


def describe_state(experiment) -> str:
  """The size of each checkpointed attribute, one copy: "params: 1,234 values, 4,936 bytes; ...".

  Read from shapes, without touching device memory. In pmap mode one
  device's copy of a CHECKPOINT_ATTRS value is counted.
  """
  attrs, non_broadcast_attrs = checkpoint_attrs(experiment)
  per_device = mesh_lib.active_mesh() is None
  parts = []
  for attr, name in [*attrs.items(), *non_broadcast_attrs.items()]:
    values = size = 0
    for leaf in jax.tree.leaves(getattr(experiment, attr, None)):
      shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
      if shape is None or dtype is None:
        continue
      if per_device and attr in attrs and shape:
        shape = shape[1:]
      count = math.prod(shape)
      values, size = values + count, size + count * dtype.itemsize
    parts.append(f"{name}: {values:,} values, {size:,} bytes")
  return "; ".join(parts) or "nothing is checkpointed"


def keyword_filtered(method):
  """Wraps `method` to receive only the keyword arguments it declares.

  Users write `step(self, global_step, rng, writer)`, keyword-only variants, or
  only the arguments they use with `**unused`; all are called with keywords.
  The signature is inspected once, not per call.
  """
  parameters = inspect.signature(method).parameters.values()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return method
  accepted = frozenset(
      p.name for p in parameters
      if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))

  @functools.wraps(method)
  def call(**kwargs):
    return method(**{k: v for k, v in kwargs.items() if k in accepted})

  return call


def kwargs_only(fn):
  """Decorator: `fn` may only be called with keyword arguments (jaxline's helper)."""

  @functools.wraps(fn)
  def call(**kwargs):
    return fn(**kwargs)

  return call


def evaluate_should_return_dict(evaluate_fn):
  """Decorator: an `evaluate` returning None yields {} and logs a warning."""

  @functools.wraps(evaluate_fn)
  def call(*args, **kwargs):
    scalars = evaluate_fn(*args, **kwargs)
    if scalars is None:
      logging.warning("[jaxline_ng] evaluate() returned None; return a dict of scalars.")
      return {}
    return scalars

  return call


class log_activity:  # pylint: disable=invalid-name  (jaxline's name, used as a context manager)
  """Logs the start, end and duration of an activity, and a failure if it raises."""

  def __init__(self, activity_name: str):
    self._name = activity_name

  def __enter__(self):
    logging.info("[jaxline_ng] %s starting...", self._name)
    self._start = time.perf_counter()

  def __exit__(self, exc_type, exc, tb):
    elapsed = time.perf_counter() - self._start
    if exc_type is None:
      logging.info("[jaxline_ng] %s finished (%.2fs).", self._name, elapsed)
    else:
      logging.error("[jaxline_ng] %s failed after %.2fs: %s", self._name, elapsed, exc)
    return False
