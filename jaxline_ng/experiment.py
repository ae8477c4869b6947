"""AbstractExperiment: the class users subclass (and fork) to define a run.

The meaning is jaxline's: the platform constructs the experiment as
`cls(mode, init_rng=..., **config.experiment_kwargs)`, calls `step` once per
training step and `evaluate` once per checkpoint, both with the keyword
arguments `global_step`, `rng` and `writer`. `global_step` and `rng` carry a
leading axis of size `jax.local_device_count()`, ready to pass to a pmap; in
training, `global_step` is a host NumPy array (so `global_step[0]` is free;
jaxline 0.0.8's was a device array), `rng` a device array.

State listed in `CHECKPOINT_ATTRS` (`{attribute: checkpoint name}`) is
pmap-replicated: one copy is checkpointed and it is restored replicated.
`NON_BROADCAST_CHECKPOINT_ATTRS` are stored and restored whole.
"""

import abc
import functools
import inspect
import math
import time
from collections.abc import Mapping
from typing import Any

import jax
from absl import logging

from jaxline_ng import base_config, devices, errors, iterator_state, preemption
from jaxline_ng import mesh as mesh_lib
from jaxline_ng import rng as rng_lib

Scalars = Mapping[str, Any]


class AbstractExperiment(abc.ABC):
  """The interface between user code and the jaxline_ng loops."""

  CHECKPOINT_ATTRS: Mapping[str, str] = {}
  NON_BROADCAST_CHECKPOINT_ATTRS: Mapping[str, str] = {}

  def __init__(self, mode: str, init_rng: jax.Array | None = None):
    """Sets nothing, as jaxline's: a subclass keeps what it needs (a
    `self.init_rng` it set before calling this stays).

    Args:
      mode: the `--jaxline_mode` the experiment runs in ("train", "eval", ...).
      init_rng: the key to initialise the experiment with; subclasses may omit it.
    """
    del mode, init_rng

  @abc.abstractmethod
  def step(self, *, global_step: jax.Array, rng: jax.Array, writer) -> Scalars:
    """Performs one training step and returns scalars to log.

    Declare only the keyword arguments you use, or take `**unused_kwargs`.
    """

  @abc.abstractmethod
  def evaluate(self, *, global_step: jax.Array, rng: jax.Array, writer) -> Scalars | None:
    """Evaluates the current (restored) state and returns scalars."""

  def should_run_step(self, global_step: int, config) -> bool:
    """Whether the loop runs the step that has seen `global_step` steps before it.

    Override for epoch- or update-count termination (`training_steps=None`).
    The evaluation loop asks it too, to learn when training has ended.
    """
    steps = config.training_steps
    if steps is None:
      raise base_config.ConfigError(
          f"config.training_steps=None, but {type(self).__name__} does not override "
          "should_run_step to say when training ends: set a number of steps")
    return global_step < steps

  def initialize_train_step_rng(self, rng: jax.Array) -> jax.Array:
    """Places the training chain's first key as `train_loop` takes it.

    `rng` is one raw key derived from `config.random_seed`. The default puts a
    copy on every local device (`[devices, 2]`, pmap mode) or replicates it
    over the mesh (mesh mode); each step splits the chain into its own key,
    specialised by `config.random_mode_train`, and the next chain key.
    """
    return mesh_lib.placement().replicate(rng)

  def train_loop(self, config, state, periodic_actions, writer=None) -> None:
    """Runs training steps until `should_run_step` says stop.

    Each step calls `step` with those of these keyword arguments it declares:
      - `global_step`: the steps completed before this one, as a new host
        `int32[local devices]` (pmap) or a host `int32` (mesh mode);
      - `rng`: the step's key, raw `uint32[local devices, 2]` with one row on
        each device (pmap) or one replicated `uint32[2]` (mesh mode);
      - `writer`: the run's writer, or None where this process writes nothing.
    Then `state.global_step` (host int) and `state.train_step_rng` (the chain
    key) are advanced, so a checkpoint taken by a periodic action always
    matches the step it was taken at, and each action is called as
    `action(time, global_step, scalars)`.

    The loop itself never waits for the devices: it dispatches steps ahead of
    them. It waits only in these actions, every one of them here:
      - a save (`loop_actions.default_periodic_actions`): the non-finite check
        reads the newest step's scalars (`guards.NonFiniteGuard.seal`); before
        a disk save the metric rows up to it are put on disk
        (`loop_actions.flush_metrics`); the chief's save waits for the other
        processes' data positions (`iterator_state.gather`) and for their
        verdicts on the steps it covers (`guards.PeerChecks.before_save`);
        a disk save first waits for the one before it to be written;
      - the non-finite guard itself, once `guards.MAX_UNCHECKED` steps' scalars
        went unread by logging (`guards.NonFiniteGuard.__call__`);
      - logging and writing, once `periodic._MOST_BEHIND` due steps wait for
        their background thread (`periodic.PeriodicAction`; the writer's own
        queue, `writers.AsyncWriter`, is bounded behind that thread);
      - with several processes, the stop agreement: JAX's preemption sync
        point after every step, which communicates once a notice has come
        (`agreement.stop_agreed`, from `preemption.StopCheck`).
    After the loop, `train` waits for the final save and meets the other
    processes at a barrier (`jaxline_ng_train_end`).
    """
    step = keyword_filtered(self.step)
    step_keys = rng_lib.StepKeys(config.random_mode_train)
    step_counter = mesh_lib.placement().step_counter
    with log_activity("training loop"):
      while self.should_run_step(state.global_step, config):
        step_rng, state.train_step_rng = step_keys.next(state.train_step_rng)
        with jax.profiler.StepTraceAnnotation("train", step_num=state.global_step):
          scalars = step(global_step=step_counter(state.global_step), rng=step_rng, writer=writer)
        state.global_step += 1
        now = time.time()
        for action in periodic_actions:
          action(now, state.global_step, scalars)

  def snapshot_state(self) -> Mapping[str, Any]:
    """One copy of every checkpointed attribute, keyed by checkpoint name.

    In pmap mode CHECKPOINT_ATTRS are read from the first device
    (`get_first`); in mesh mode they are global arrays and taken whole.
    Both are fresh buffers (`get_first` reads into new ones and
    NON_BROADCAST_CHECKPOINT_ATTRS' device arrays are copied), so the caller
    may keep them while training donates the live ones.
    """
    return checkpointed_values(self, fresh=True)

  def restore_from_snapshot(self, snapshot_state: Mapping[str, Any]) -> None:
    """Sets checkpointed attributes from a snapshot.

    pmap mode replicates CHECKPOINT_ATTRS over the local devices; mesh mode
    places them with the shardings the attributes have now (as `__init__`
    made them), so sharded parameters come back sharded the same way.
    """
    attrs, non_broadcast_attrs = checkpoint_attrs(self)
    for attr, name in {**attrs, **non_broadcast_attrs}.items():
      if isinstance(snapshot_state[name], iterator_state.Position):
        iterator_state.restore_attribute(self, attr, snapshot_state[name],
                                         f"experiment_module/{name}")
    for attr, name in attrs.items():
      if isinstance(snapshot_state[name], iterator_state.Position):
        continue
      value = mesh_lib.placement().restored(getattr(self, attr, None), snapshot_state[name])
      setattr(self, attr, devices.restored_like(getattr(self, attr, None), value))
    for attr, name in non_broadcast_attrs.items():
      if not isinstance(snapshot_state[name], iterator_state.Position):
        setattr(self, attr, devices.restored_like(getattr(self, attr, None), snapshot_state[name]))

  def on_new_best_model(self, best_state) -> None:
    """Called after evaluation finds a new best metric, before `best` is saved.

    `best_state.global_step` and `best_state.best_eval_metric_value` describe it.
    """


def checkpoint_attrs(experiment) -> tuple[Mapping[str, str], Mapping[str, str]]:
  """The experiment's (CHECKPOINT_ATTRS, NON_BROADCAST_CHECKPOINT_ATTRS).

  Either may be a class attribute or an instance property, and None means {}.
  """
  return (getattr(experiment, "CHECKPOINT_ATTRS", None) or {},
          getattr(experiment, "NON_BROADCAST_CHECKPOINT_ATTRS", None) or {})


def checkpointed_values(experiment, fresh: bool) -> dict[str, Any]:
  """`AbstractExperiment.snapshot_state` of `experiment`.

  Args:
    experiment: the experiment.
    fresh: copy device arrays into new buffers. Without, mesh-mode arrays are
      the live ones: for a saver that copies them before training goes on
      (orbax's save), a second copy would only double the memory a save takes.

  Returns:
    The snapshot, keyed by checkpoint name.
  """
  attrs, non_broadcast_attrs = checkpoint_attrs(experiment)
  if not attrs and not non_broadcast_attrs and not _overrides_snapshot(experiment):
    # Once: saves every few steps would repeat it.
    logging.log_first_n(
        logging.WARNING, "%s declares no CHECKPOINT_ATTRS or NON_BROADCAST_CHECKPOINT_ATTRS: "
        "checkpoints will hold no experiment state.", 1, type(experiment).__name__)
  copies = devices.fresh_copies if fresh else (lambda tree: tree)
  # Iterators that report their position are saved as it, per process.
  positions = {name: iterator_state.capture(getattr(experiment, attr), f"experiment_module/{name}")
               for attr, name in {**attrs, **non_broadcast_attrs}.items()
               if iterator_state.kind_of(getattr(experiment, attr, None)) is not None}
  try:
    snapshot = dict(mesh_lib.placement().one_copy(
        {name: getattr(experiment, attr) for attr, name in attrs.items() if name not in positions},
        fresh))
    for attr, name in non_broadcast_attrs.items():
      if name not in positions:
        snapshot[name] = copies(getattr(experiment, attr))
  except (AttributeError, TypeError, IndexError, ValueError):
    problem = checkpoint_attrs_problem(experiment)  # Looked for only now: saves are frequent.
    if problem:
      raise CheckpointAttrsError(problem) from None
    raise
  snapshot.update(positions)
  return snapshot


class CheckpointAttrsError(AttributeError, errors.OneLineError):
  """An entry of CHECKPOINT_ATTRS cannot be checkpointed; the message names it."""


def checkpoint_attrs_problem(experiment) -> str | None:
  """Why `snapshot_state` cannot take the experiment's checkpointed
  attributes (one missing, or in pmap mode a CHECKPOINT_ATTRS value that is
  not one copy per device), or None. Reads device memory only of arrays
  that are not laid out as pmap outputs."""
  if _overrides_snapshot(experiment):
    return None
  attrs, non_broadcast_attrs = checkpoint_attrs(experiment)
  name = type(experiment).__name__
  owners: dict[str, str] = {}
  for attr, checkpoint_name in [*attrs.items(), *non_broadcast_attrs.items()]:
    if checkpoint_name in owners:  # The snapshot would keep one of the two values.
      return (f"{name} gives the checkpoint name {checkpoint_name!r} to both "
              f"{owners[checkpoint_name]!r} and {attr!r} (CHECKPOINT_ATTRS, "
              "NON_BROADCAST_CHECKPOINT_ATTRS): give each its own")
    owners[checkpoint_name] = attr
  for key, entries in (("CHECKPOINT_ATTRS", attrs),
                       ("NON_BROADCAST_CHECKPOINT_ATTRS", non_broadcast_attrs)):
    for attr in entries:
      if not hasattr(experiment, attr):
        return (f"{name}.{key} names {attr!r}, which {name} does not have: set it in "
                "__init__ (None until step builds it) or fix the name")
  if mesh_lib.placement().per_device:
    count = jax.local_device_count()
    for attr in attrs:
      if iterator_state.kind_of(getattr(experiment, attr)) is not None:
        continue
      for leaf in jax.tree.leaves(getattr(experiment, attr)):
        if getattr(leaf, "ndim", 0) < 1:
          return (f"{name}.CHECKPOINT_ATTRS entry {attr!r} holds {type(leaf).__name__} "
                  f"{leaf!r:.40}, which has no device axis: in pmap mode these hold a copy per "
                  "device (utils.bcast_local_devices); list host values in "
                  "NON_BROADCAST_CHECKPOINT_ATTRS")
        # Only the first row is saved: rows that differ would be lost. Laid
        # out as pmap lays out its outputs, they are copies; otherwise (a
        # host array, one on one device) they are read, once.
        if leaf.shape[0] != count or not (
            devices.one_row_per_device(leaf) or devices.equal_rows(leaf)):
          return (f"{name}.CHECKPOINT_ATTRS entry {attr!r} holds an array of shape "
                  f"{tuple(leaf.shape)} that is not one copy per local device ({count}): only "
                  "the first row would be saved; place it with utils.bcast_local_devices, or "
                  "list it in NON_BROADCAST_CHECKPOINT_ATTRS")
  return None


# Per-device copies compared after the first step, per leaf: BatchNorm
# statistics and the like are small, and reading every copy of large weights
# would cost the start-up time and host memory.
_COMPARED_BYTES = 1 << 20


def differing_copies(experiment) -> list[str]:
  """The CHECKPOINT_ATTRS entries (pmap mode) with a leaf of at most 1 MiB whose
  per-device copies differ: a checkpoint keeps the first device's alone."""
  if _overrides_snapshot(experiment) or not mesh_lib.placement().per_device:
    return []
  differing = []
  for attr in checkpoint_attrs(experiment)[0]:
    if any(devices.one_row_per_device(leaf) and leaf.is_fully_addressable
           and leaf.nbytes <= _COMPARED_BYTES and not devices.equal_rows(leaf)
           for leaf in jax.tree.leaves(getattr(experiment, attr, None))):
      differing.append(attr)
  return differing


def _overrides_snapshot(experiment) -> bool:
  """Whether the experiment's own `snapshot_state` adds to (or replaces) the attributes'."""
  return type(experiment).snapshot_state is not AbstractExperiment.snapshot_state


def describe_state(experiment) -> str:
  """The size of each checkpointed attribute, one copy: "params: 1,234 values, 4,936 bytes; ...".

  Read from shapes, without touching device memory. In pmap mode one
  device's copy of a CHECKPOINT_ATTRS value is counted.
  """
  attrs, non_broadcast_attrs = checkpoint_attrs(experiment)
  per_device = mesh_lib.placement().per_device
  parts = []
  for attr, name in [*attrs.items(), *non_broadcast_attrs.items()]:
    value = getattr(experiment, attr, None)
    if value is None:
      parts.append(f"{name}: not built yet")
      continue
    if iterator_state.kind_of(value) is not None:
      parts.append(f"{name}: an iterator's position ({iterator_state.kind_of(value)})")
      continue
    values = size = 0
    plain = []  # Python numbers and strings, shown as they are.
    for leaf in jax.tree.leaves(value):
      shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
      if shape is None or dtype is None:
        plain.append(repr(leaf))
        continue
      if per_device and attr in attrs and shape:
        shape = shape[1:]
      count = math.prod(shape)
      values, size = values + count, size + count * dtype.itemsize
    if plain and not values:
      parts.append(f"{name}: {', '.join(plain):.60}")
    else:
      parts.append(f"{name}: {values:,} values, {size:,} bytes")
  if _overrides_snapshot(experiment):
    parts.append(f"what {type(experiment).__name__}.snapshot_state returns")
  return "; ".join(parts) or "nothing is checkpointed"


def keyword_filtered(method):
  """Wraps `method` to receive only the keyword arguments it declares.

  Users write `step(self, global_step, rng, writer)`, keyword-only variants, or
  only the arguments they use with `**unused`; all are called with keywords.
  The signature is inspected once, not per call.
  """
  parameters = inspect.signature(method).parameters.values()
  accepted = frozenset(
      p.name for p in parameters
      if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
  if (any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
      or accepted >= {"global_step", "rng", "writer"}):
    return method  # Takes every keyword the loops pass: no wrapper to pay for at each call.

  @functools.wraps(method)
  def call(**kwargs):
    return method(**{k: v for k, v in kwargs.items() if k in accepted})

  return call


def kwargs_only(f):
  """Decorator: `f` may only be called with keyword arguments (jaxline's helper)."""

  @functools.wraps(f)
  def call(**kwargs):
    return f(**kwargs)

  return call


def evaluate_should_return_dict(f):
  """Decorator: an `evaluate` returning None yields {} and logs a warning."""

  @functools.wraps(f)
  def call(*args, **kwargs):
    scalars = f(*args, **kwargs)
    if scalars is None:
      logging.log_first_n(logging.WARNING,
                          "[jaxline_ng] evaluate() returned None; return a dict of scalars.", 1)
      return {}
    return scalars

  return call


class log_activity:  # pylint: disable=invalid-name  (jaxline's name)
  """Logs the start and end of an activity, and a failure with its traceback.

  A context manager, and a decorator as jaxline's (a `contextlib.contextmanager`)
  was. Its lines are jaxline's, word for word (jaxline's tests and log readers
  match them), where every other line of jaxline_ng's starts `[jaxline_ng]`.
  """

  def __init__(self, activity_name: str):
    self._name = activity_name

  def __call__(self, f):
    @functools.wraps(f)
    def logged(*args, **kwargs):
      # A context of its own per call: calls may overlap (threads, recursion).
      with log_activity(self._name):
        return f(*args, **kwargs)

    return logged

  def __enter__(self):
    logging.info("[jaxline] %s starting...", self._name)

  def __exit__(self, exc_type, exc, tb):
    if exc_type is None:
      logging.info("[jaxline] %s finished.", self._name)
    elif isinstance(exc, errors.OneLineError):  # Bad input or output: the message says it all.
      logging.error("[jaxline] %s failed: %s", self._name, exc)
    elif issubclass(exc_type, Exception) and not issubclass(exc_type, preemption.Preempted):
      # The traceback is logged here, where the activity is named: a failure
      # on a background thread may be re-raised far from it, or not at all.
      logging.exception("[jaxline] %s failed with error.", self._name)
    else:  # A requested stop, KeyboardInterrupt, SystemExit: not a failure to explain.
      logging.warning("[jaxline] %s stopped: %s", self._name, exc or exc_type.__name__)
    return False


def construct(experiment_class, mode: str, init_rng, experiment_kwargs):
  """`experiment_class(mode, init_rng=init_rng, **experiment_kwargs)`, as jaxline does.

  A constructor without an `init_rng` parameter is called without it, with a
  deprecation warning: such experiments seed themselves from their config.
  Keyword arguments the constructor does not take (or lacks) are a
  ConfigError naming `config.experiment_kwargs`.
  """
  if not hasattr(experiment_kwargs, "keys"):  # A dict or a ConfigDict (not a Mapping).
    raise base_config.ConfigError(
        f"config.experiment_kwargs={experiment_kwargs!r:.60} must be a ConfigDict of the "
        f"keyword arguments of {experiment_class.__name__}.__init__")
  signature = inspect.signature(experiment_class)
  takes_rng = "init_rng" in signature.parameters
  try:
    signature.bind(mode, **({"init_rng": init_rng} if takes_rng else {}), **experiment_kwargs)
  except TypeError as e:
    raise base_config.ConfigError(
        f"config.experiment_kwargs ({', '.join(experiment_kwargs) or 'empty'}) does not fit "
        f"{experiment_class.__name__}.__init__{signature}: {e}") from None
  if takes_rng:
    return experiment_class(mode, init_rng=init_rng, **experiment_kwargs)
  logging.warning(
      "[jaxline_ng] %s.__init__ takes no init_rng: add it and initialise the model "
      "from it (it derives from config.random_seed); constructing without it is "
      "deprecated, as in jaxline.", experiment_class.__name__)
  return experiment_class(mode, **experiment_kwargs)
