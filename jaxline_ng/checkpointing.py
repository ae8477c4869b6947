"""The Checkpointer base class, the training state it saves, and in-memory series.

A run's state is an unlocked ConfigDict, as jaxline's: `global_step`,
`train_step_rng` (the chain key), `experiment_module` (and on `best`,
`best_eval_metric_value`). `InMemoryCheckpointer` keeps jaxline's layout in
`GLOBAL_CHECKPOINT_DICT` (`utils.GLOBAL_CHECKPOINT_DICT`), which published code
reads and builds directly: `{series: CheckpointNT(active=threading.local(),
history=[SnapshotNT(id, pickle_nest), ...])}`, one active state per thread.
"""

import collections
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

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


def new_state() -> ml_collections.ConfigDict:
  """An empty run state: an unlocked ConfigDict, not type-safe (as jaxline's)."""
  return ml_collections.ConfigDict(type_safe=False)


def snapshotted_items(state) -> dict[str, Any]:
  """The entries of `state` a checkpoint holds (ConfigDicts as dicts), but the experiment."""
  return {name: value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
          for name, value in state.items() if name != "experiment_module"}


# What overriding each method makes a subclass lose unless it declares it again.
_CAPABILITIES_OF = {
    "get_experiment_state": ("keeps_run_entries",),
    "save": ("keeps_run_entries", "validates_saves"),
    "restore": ("keeps_run_entries", "restores_saved_entries", "restores_by_path",
                "in_memory_only"),
    "can_be_restored": ("in_memory_only",),
    "restore_path": ("in_memory_only",),
}


class Checkpointer:
  """How the loops save and restore a run's state by series name (`latest`, `best`).

  jaxline's six methods, and capabilities beyond them as class attributes whose
  defaults ask for nothing. A subclass overriding a method loses the ones that
  describe it unless it declares them again (code written for jaxline subclasses
  `utils.InMemoryCheckpointer` and expects jaxline's behaviour).
  """

  # `save(series, validate=fn)` dispatches its copies, then calls `fn`, which
  # vetoes the save by raising (the non-finite guard waits meanwhile).
  validates_saves: bool = False
  # The `latest` state keeps jaxline_ng's entries (the run's config, the saving
  # clock) beside jaxline's, which alone code written for jaxline may save.
  keeps_run_entries: bool = False
  # `restore` loads the entries the checkpoint holds, not those the state holds.
  restores_saved_entries: bool = False
  # Every process reads the checkpoints the chief saves (on storage they
  # share), and `restore(series, path=p)` loads the one `restore_path` gave.
  restores_by_path: bool = False
  # Checkpoints live in this process's memory alone: a new process starts afresh.
  in_memory_only: bool = False
  # Every process takes part in each save (writing its shards).
  every_process_saves: bool = False
  # The `restore_path` checkpoint a fresh training run started from, if any.
  started_from: str | None = None
  # Newer checkpoints than the one the last `restore` loaded, which it could not load.
  unloadable_newer: Sequence[str] = ()

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    for method, capabilities in _CAPABILITIES_OF.items():
      if method in vars(cls):
        for capability in capabilities:
          if capability not in vars(cls):
            setattr(cls, capability, False)

  def get_experiment_state(self, ckpt_series: str) -> ml_collections.ConfigDict:
    """The live state of `ckpt_series` (for the calling thread)."""
    raise NotImplementedError

  def save(self, ckpt_series: str) -> None:
    """Snapshots the live state of `ckpt_series` as its newest checkpoint."""
    raise NotImplementedError

  def can_be_restored(self, ckpt_series: str) -> bool:
    """Whether `ckpt_series` has a checkpoint."""
    raise NotImplementedError

  def restore(self, ckpt_series: str) -> None:
    """Loads the newest checkpoint of `ckpt_series` into its live state."""
    raise NotImplementedError

  def restore_path(self, ckpt_series: str) -> Any | None:
    """An id of the newest checkpoint (changes when a new one is saved), or None."""
    raise NotImplementedError

  def wait_for_checkpointing_to_finish(self) -> None:
    """Blocks until every save started so far is complete."""
    raise NotImplementedError

  def set_aside(self, ckpt_series: str) -> bool:
    """Moves `ckpt_series` aside (kept), so that it starts afresh.

    Returns:
      Whether it was: by default not, as a user's checkpointer may hold the only copy.
    """
    del ckpt_series
    return False

  @property
  def class_name(self) -> str:
    """The name of the checkpointer's class, as messages name it to the user."""
    return type(self).__name__


class JaxlineCheckpointerAdapter(Checkpointer):
  """A checkpointer written for jaxline (any object with its six methods), used with
  no capability beyond them."""

  def __init__(self, checkpointer):
    self.wrapped = checkpointer

  def get_experiment_state(self, ckpt_series: str):
    return self.wrapped.get_experiment_state(ckpt_series)

  def save(self, ckpt_series: str) -> None:
    self.wrapped.save(ckpt_series)

  def can_be_restored(self, ckpt_series: str) -> bool:
    return self.wrapped.can_be_restored(ckpt_series)

  def restore(self, ckpt_series: str) -> None:
    self.wrapped.restore(ckpt_series)

  def restore_path(self, ckpt_series: str) -> Any | None:
    return self.wrapped.restore_path(ckpt_series)

  def wait_for_checkpointing_to_finish(self) -> None:
    self.wrapped.wait_for_checkpointing_to_finish()

  @property
  def class_name(self) -> str:
    return type(self.wrapped).__name__


def every_host_saves(checkpointer: Checkpointer, all_hosts_key: str, config) -> bool:
  """Whether every process saves the series `config.<all_hosts_key>` is about (else the chief).

  Every process does where each writes its shards, or where the config asks
  for every host's copy (jaxline's `*_checkpoint_all_hosts`) and something
  would read it. Where every process restores the chief's checkpoints
  (`restores_by_path`), the others' copies would never be read, so the key is
  ignored with a warning. The same answer in every process.
  """
  if checkpointer.every_process_saves:
    return True
  if not config[all_hosts_key]:
    return False
  if checkpointer.restores_by_path:
    if jax.process_count() > 1:
      logging.log_first_n(
          logging.WARNING, "[jaxline_ng] config.%s=True is ignored: every process restores the "
          "chief's checkpoints, so the other processes' copies would never be read.", 1,
          all_hosts_key)
    return False
  return True


def adapt(checkpointer) -> Checkpointer:
  """`checkpointer` as a `Checkpointer`: itself if it is one, else adapted."""
  if isinstance(checkpointer, Checkpointer):
    return checkpointer
  return JaxlineCheckpointerAdapter(checkpointer)


def device_snapshot(state, fresh: bool = True) -> dict[str, Any]:
  """What a checkpoint of `state` holds, in fresh device buffers (dispatched, not waited
  for), so training may donate the live ones; without `fresh`, maybe the live ones.

  An overridden `snapshot_state()` may return live buffers: they are copied.
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


def restore_snapshot(state: ml_collections.ConfigDict, nest: dict[str, Any]) -> None:
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


class InMemoryCheckpointer(Checkpointer):
  """Keeps up to `max_checkpoints_to_keep` snapshots per series, on device as jaxline did:
  `save` appends one before it returns, its `pickle_nest` a ConfigDict."""

  validates_saves = True
  keeps_run_entries = True
  restores_saved_entries = True
  in_memory_only = True

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

  def get_experiment_state(self, ckpt_series: str) -> ml_collections.ConfigDict:
    active = self._series(ckpt_series).active
    if not hasattr(active, "state"):
      active.state = new_state()
    return active.state

  def save(self, ckpt_series: str, *, validate: Callable[[], None] | None = None) -> None:
    """Snapshots the live state of `ckpt_series`; `validate()` may veto it by raising."""
    nest = device_snapshot(self.get_experiment_state(ckpt_series))  # Copied while validating.
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
  """A directory for `host_id`'s own files under `config.checkpoint_dir`, created
  (not public jaxline's, but published experiments call it)."""
  path = os.path.join(config.checkpoint_dir, f"host_{host_id}")
  os.makedirs(path, exist_ok=True)
  return path
