"""The Checkpointer protocol, the training state it saves, and in-memory series.

A checkpointer keeps named series (`latest`, `best`) of snapshots of an
`ExperimentState`. The loops mutate the state a checkpointer hands out with
`get_experiment_state(series)` and call `save`/`restore` on the series name;
the checkpointer decides where snapshots live.

`InMemoryCheckpointer` keeps jaxline's layout in `GLOBAL_CHECKPOINT_DICT`:
`{series: CheckpointNT(active=threading.local(), history=[SnapshotNT(id,
pickle_nest), ...])}`. Each thread has its own active state (so the train and
eval threads of `train_eval_multithreaded` do not share one), while the
history is shared. Published experiments and tests read and build these
entries directly, in the jaxline 0.0.8 layout (`pickle_nest['experiment_module']`
is the experiment's `snapshot_state()` dict) and the earlier one (it is the
experiment object itself); both restore. They reach the dict as jaxline's
`utils.GLOBAL_CHECKPOINT_DICT`, which `utils` re-exports; rebinding it there
rebinds it here.
"""

import collections
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

import jax
import ml_collections
import numpy as np
from absl import logging

from jaxline_ng import devices, rng
from jaxline_ng import experiment as experiment_lib

SnapshotNT = collections.namedtuple("SnapshotNT", ["id", "pickle_nest"])
CheckpointNT = collections.namedtuple("CheckpointNT", ["active", "history"])

# The in-memory series, by name. Read at call time, never captured: published
# tests rebind it (as `utils.GLOBAL_CHECKPOINT_DICT`) to a dict of their own.
GLOBAL_CHECKPOINT_DICT: dict[str, CheckpointNT] = {}


class CheckpointSuperseded(Exception):
  """The checkpoint a reader chose went while it read it, and a newer one is
  there: the writer's `max_checkpoints_to_keep` rotated it out. An evaluator
  goes on to the newer one."""


class ExperimentState:
  """What a checkpoint series holds for a run: attributes set by the loops.

  `global_step` (int, steps completed), `train_step_rng` (the chain key),
  `experiment_module` (the experiment); on the `best` series also
  `best_eval_metric_value`. Only attributes that were set exist, so a
  snapshot holds exactly what the loops put there, as jaxline's ConfigDict
  state did. Code written for jaxline reads, sets and prints it as that
  ConfigDict (`state[name] = value` in jaxline's restore, `print(best_state)`
  in `on_new_best_model`), so those work as there. It is no `ConfigDict`
  (no `lock`): the loops set it every step, which a ConfigDict's checks slow.
  """

  def __contains__(self, name: str) -> bool:
    return name in vars(self)

  def __getitem__(self, name: str) -> Any:
    try:
      return vars(self)[name]
    except KeyError:
      raise KeyError(f"the experiment state has no entry {name!r}; it has "
                     f"{sorted(vars(self))}") from None

  def __setitem__(self, name: str, value: Any) -> None:
    setattr(self, name, value)

  def get(self, name: str, default: Any = None) -> Any:
    return vars(self).get(name, default)

  def __iter__(self):
    return iter(vars(self))

  def __len__(self) -> int:
    return len(vars(self))

  def keys(self):
    return vars(self).keys()

  def values(self):
    return vars(self).values()

  def items(self):
    return vars(self).items()

  def update(self, *others, **entries) -> None:
    """Sets the entries of each mapping in `others`, then `entries` (as ConfigDict's)."""
    for other in (*others, entries):
      for name, value in other.items():
        setattr(self, name, value)

  def to_dict(self) -> dict[str, Any]:
    return dict(vars(self))

  def __repr__(self) -> str:
    # One `name: value` line per entry, sorted, as a ConfigDict prints.
    return "\n".join(f"{name}: {value!r}" for name, value in sorted(vars(self).items()))


def snapshotted_items(state) -> dict[str, Any]:
  """The entries of `state` (an `ExperimentState` or a jaxline ConfigDict) a
  checkpoint holds: all but the experiment, which is snapshotted through its
  own `snapshot_state`."""
  return {name: value for name, value in state.items() if name != "experiment_module"}


class Checkpointer(Protocol):
  """How the loops save and restore `ExperimentState`s by series name."""

  def get_experiment_state(self, ckpt_series: str) -> ExperimentState:
    """The live state of `ckpt_series` (for the calling thread)."""

  def save(self, ckpt_series: str) -> None:
    """Snapshots the live state of `ckpt_series` as its newest checkpoint."""

  def can_be_restored(self, ckpt_series: str) -> bool:
    """Whether `ckpt_series` has a checkpoint."""

  def restore(self, ckpt_series: str) -> None:
    """Loads the newest checkpoint of `ckpt_series` into its live state."""

  def restore_path(self, ckpt_series: str) -> Any | None:
    """An id of the newest checkpoint (changes when a new one is saved), or None."""

  def wait_for_checkpointing_to_finish(self) -> None:
    """Blocks until every save started so far is complete."""


def device_snapshot(state, fresh: bool = True) -> dict[str, Any]:
  """What a checkpoint of `state` holds, in fresh device buffers (dispatched, not waited for).

  The experiment's part is its `snapshot_state()`, which makes fresh
  buffers; an override may return live ones, so those are copied. Training
  may then donate or replace the live arrays without touching the snapshot,
  and taking it does not wait for the devices. The loop's
  own entries (the step, the chain key) are replaced each step, never
  donated, so they are kept as they are. Without `fresh`, arrays may be the
  live ones: for a saver that copies them before training goes on.
  """
  nest = snapshotted_items(state)
  module = getattr(state, "experiment_module", None)
  if module is not None:
    if type(module).snapshot_state is not experiment_lib.AbstractExperiment.snapshot_state:
      snapshot = module.snapshot_state()
      snapshot = devices.fresh_copies(snapshot) if fresh else snapshot
    else:
      snapshot = experiment_lib.checkpointed_values(module, fresh)
    nest["experiment_module"] = dict(snapshot)
  return nest


def restore_snapshot(state: ExperimentState, nest: dict[str, Any]) -> None:
  """Loads a snapshot (either jaxline layout) into `state`."""
  for name, value in nest.items():
    if name == "experiment_module":
      module = getattr(state, "experiment_module", None)
      if module is None:
        continue
      if isinstance(value, experiment_lib.AbstractExperiment):
        # Pre-0.0.8 layout: the snapshot is the experiment object itself.
        attrs, non_broadcast_attrs = experiment_lib.checkpoint_attrs(value)
        for attr in (*attrs, *non_broadcast_attrs):
          setattr(module, attr, getattr(value, attr))
      else:
        module.restore_from_snapshot(value)
    elif name == "global_step":
      state.global_step = int(np.ravel(jax.device_get(value))[0])
    elif name == "train_step_rng":
      if value is not None:
        state.train_step_rng = rng.place_chain(value, like=getattr(state, "train_step_rng", None))
    else:
      setattr(state, name, value)


def in_memory_only(checkpointer) -> bool:
  """Whether `checkpointer` finds checkpoints in this process's memory alone: an
  InMemoryCheckpointer whose subclass (if any) does not look elsewhere."""
  base = InMemoryCheckpointer
  return (isinstance(checkpointer, base)
          and type(checkpointer).can_be_restored is base.can_be_restored
          and type(checkpointer).restore_path is base.restore_path)


class InMemoryCheckpointer:
  """Keeps up to `max_checkpoints_to_keep` snapshots per series, on device as jaxline did.

  As jaxline: `save` appends a snapshot to the series before it returns, so
  `history[-1]` is that save, its `pickle_nest` a `ConfigDict`. Its arrays
  are fresh device copies (`device_snapshot`), dispatched before the
  non-finite check waits for the newest step, so the devices copy meanwhile.
  """

  def __init__(self, config, mode: str):
    del mode  # Series are shared by every mode in the process.
    self._max_checkpoints_to_keep = config.max_checkpoints_to_keep
    self._lock = threading.Lock()

  def _series(self, ckpt_series: str) -> CheckpointNT:
    checkpoints = GLOBAL_CHECKPOINT_DICT
    with self._lock:
      if ckpt_series not in checkpoints:
        checkpoints[ckpt_series] = CheckpointNT(threading.local(), [])
      return checkpoints[ckpt_series]

  def get_experiment_state(self, ckpt_series: str) -> ExperimentState:
    active = self._series(ckpt_series).active
    if not hasattr(active, "state"):
      active.state = ExperimentState()
    return active.state

  def save(self, ckpt_series: str, *, validate: Callable[[], None] | None = None) -> None:
    """Snapshots the live state of `ckpt_series`; `validate()` may veto it by raising."""
    nest = device_snapshot(self.get_experiment_state(ckpt_series))
    # Validating waits for the step to finish: the copies dispatched first keep
    # the devices busy meanwhile, not idle while the host makes them.
    if validate is not None:
      validate()
    snapshot = ml_collections.ConfigDict(nest)
    series = self._series(ckpt_series)
    with self._lock:
      next_id = series.history[-1].id + 1 if series.history else 0
      series.history.append(SnapshotNT(next_id, snapshot))
      del series.history[:-self._max_checkpoints_to_keep]
    logging.info("[jaxline_ng] Saved in-memory checkpoint %s/%d at step %s.",
                 ckpt_series, next_id, nest.get("global_step"))

  def can_be_restored(self, ckpt_series: str) -> bool:
    series = GLOBAL_CHECKPOINT_DICT.get(ckpt_series)
    return bool(series and series.history)

  def restore(self, ckpt_series: str) -> None:
    snapshot = self._series(ckpt_series).history[-1]
    nest = snapshot.pickle_nest
    if isinstance(nest, ml_collections.ConfigDict):
      nest = nest.to_dict()
    restore_snapshot(self.get_experiment_state(ckpt_series), nest)
    logging.info("[jaxline_ng] Restored in-memory checkpoint %s/%d.", ckpt_series, snapshot.id)

  def restore_path(self, ckpt_series: str) -> int | None:
    if not self.can_be_restored(ckpt_series):
      return None
    return GLOBAL_CHECKPOINT_DICT[ckpt_series].history[-1].id

  def wait_for_checkpointing_to_finish(self) -> None:
    """Nothing to wait for: saves are complete when `save` returns."""


def get_checkpoint_dir(config, host_id: int) -> str:
  """A directory for `host_id`'s own files under `config.checkpoint_dir`, created.

  Not in public jaxline, but published experiments call it to place files
  they write themselves (e.g. an exported best model).
  """
  path = os.path.join(config.checkpoint_dir, f"host_{host_id}")
  os.makedirs(path, exist_ok=True)
  return path


_OUR_CHECKPOINTERS = ("jaxline_ng.checkpointing", "jaxline_ng.disk_checkpointing")


def is_ours(checkpointer, method: str) -> bool:
  """Whether `checkpointer`'s `method` is jaxline_ng's (not a user's override)."""
  # Looked up on the class: a `mock.Mock()` or a wrapper forwarding through
  # `__getattr__` has the method on the instance alone.
  return getattr(getattr(type(checkpointer), method, None), "__module__",
                 None) in _OUR_CHECKPOINTERS


def every_process_saves(checkpointer) -> bool:
  """Whether every process takes part in each save (a disk checkpoint of arrays
  sharded over several processes: each writes its own shards)."""
  return getattr(checkpointer, "every_process_saves", False) is True  # Not a Mock's attribute.


def keeps_run_entries(checkpointer, state) -> bool:
  """Whether the `latest` state keeps jaxline_ng's entries beside jaxline's:
  the run's config (compared on resume) and when the last periodic save ran.
  They are read back only where they are kept: any other state may hold
  anything under those names (a `mock.Mock()` checkpointer's, which published
  tests pass, has every attribute).

  Only where jaxline_ng's own checkpointers save and restore its own state:
  code written for jaxline (a checkpointer of its own, or a subclass of
  `utils.InMemoryCheckpointer` saving elsewhere too) expects jaxline's
  entries alone, and may lock them or save them with a library that refuses
  a string or a dict of tuples.
  """
  return (isinstance(state, ExperimentState)
          and is_ours(checkpointer, "restore")
          and is_ours(checkpointer, "save"))
