"""The Checkpointer protocol, the training state it saves, and in-memory series.

A checkpointer keeps named series (`latest`, `best`) of snapshots of an
`ExperimentState`. The loops mutate the state a checkpointer hands out with
`get_experiment_state(series)` and call `save`/`restore` on the series name;
the checkpointer decides where snapshots live.

`InMemoryCheckpointer` keeps jaxline's layout in `utils.GLOBAL_CHECKPOINT_DICT`:
`{series: CheckpointNT(active=threading.local(), history=[SnapshotNT(id,
pickle_nest), ...])}`. Each thread has its own active state (so the train and
eval threads of `train_eval_multithreaded` do not share one), while the
history is shared. Published experiments and tests read and build these
entries directly, in the jaxline 0.0.8 layout (`pickle_nest['experiment_module']`
is the experiment's `snapshot_state()` dict) and the earlier one (it is the
experiment object itself); both restore.
"""

import collections
import concurrent.futures
import os
import threading
from typing import Any, Callable, Optional, Protocol

import jax
import numpy as np
from absl import logging

from jaxline_ng import devices
from jaxline_ng import rng

SnapshotNT = collections.namedtuple("SnapshotNT", ["id", "pickle_nest"])
CheckpointNT = collections.namedtuple("CheckpointNT", ["active", "history"])

# Not part of a snapshot: the experiment is snapshotted through its own
# `snapshot_state`, and the config is the running process's, not the saved one's.
_NOT_SNAPSHOTTED = ("experiment_module", "config")


class ExperimentState:
  """What a checkpoint series holds for a run.

  Attributes set by the loops: `global_step` (int, steps completed),
  `train_step_rng` (per-device chain key), `experiment_module` (the
  experiment), `config`; on the `best` series also `best_eval_metric_value`.
  Supports `name in state` like jaxline's ConfigDict state did.

  The training loop sets `train_step_rng` to an `rng.PendingChainKey` each
  step; reading the attribute turns it into the key array, once.
  """

  def __init__(self):
    self.global_step = 0
    self.train_step_rng = None
    self.experiment_module = None
    self.config = None

  @property
  def train_step_rng(self):
    value = vars(self)["train_step_rng"]
    if isinstance(value, rng.PendingChainKey):
      value = vars(self)["train_step_rng"] = value.resolve()
    return value

  @train_step_rng.setter
  def train_step_rng(self, value):
    vars(self)["train_step_rng"] = value

  def __contains__(self, name: str) -> bool:
    return name in vars(self)

  def snapshotted_items(self, *, resolve_keys: bool = True) -> dict[str, Any]:
    """The attributes a checkpoint holds; with `resolve_keys=False`, a pending
    `train_step_rng` stays a `rng.PendingChainKey` (for `devices.to_host`)."""
    items = vars(self) if not resolve_keys else {k: getattr(self, k) for k in vars(self)}
    return {k: v for k, v in items.items() if k not in _NOT_SNAPSHOTTED}


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

  def restore_path(self, ckpt_series: str) -> Optional[Any]:
    """An id of the newest checkpoint (changes when a new one is saved), or None."""

  def wait_for_checkpointing_to_finish(self) -> None:
    """Blocks until every save started so far is complete."""


def global_checkpoint_dict() -> dict[str, CheckpointNT]:
  """The dict in-memory series live in: `utils.GLOBAL_CHECKPOINT_DICT`.

  It has one binding, on the module published code reads it from, and is
  looked up at call time because published tests rebind it to a dict of
  their own.
  """
  from jaxline_ng import utils  # Deferred: utils re-exports this module.
  return utils.GLOBAL_CHECKPOINT_DICT


def device_snapshot(state: ExperimentState) -> dict[str, Any]:
  """`state` in jaxline 0.0.8's snapshot layout, with fresh device copies of its arrays.

  Cheap for the calling thread: copies are dispatched, not waited for. Being
  new buffers, donating the live state in the next step, or anything the
  loop dispatches later, cannot change the snapshot. With the default
  `snapshot_state`, pmap-replicated attributes are packed together
  (`devices.packed_first`: one dispatch, one buffer per dtype; the first
  device's part is taken and unpacked by `SaveWorker`) and mesh-mode ones
  copied; an overridden `snapshot_state` is copied here. The training key
  chain is never donated, so it is taken as it is; a pending one
  (`rng.PendingChainKey`) is taken out of its dispatch's stacked keys on
  the save worker, too.
  """
  # Deferred: experiment imports this module's users, not the other way round.
  from jaxline_ng import experiment as experiment_lib

  nest = state.snapshotted_items(resolve_keys=False)
  module = state.experiment_module
  if module is not None:
    if type(module).snapshot_state is experiment_lib.AbstractExperiment.snapshot_state:
      snapshot = module._snapshot(one_copy=devices.packed_first)  # pylint: disable=protected-access
    else:
      snapshot = devices.fresh_copies(module.snapshot_state())
    nest["experiment_module"] = snapshot
  return nest


class SaveWorker:
  """One background thread that finishes saves in the order they were made.

  `submit(nest, validate, persist)` first waits for the previous save (so
  at most one snapshot waits on the devices), then returns while, on the
  worker, the snapshot is copied to host memory (`devices.to_host`),
  `validate()` runs (it may wait for the step's outputs; if it raises, the
  snapshot is dropped and the validator reports its own failure) and
  `persist(host_nest)` stores it. An error while persisting is raised on
  the caller's thread by the next `submit` or by `wait`.
  """

  def __init__(self, name: str):
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                           thread_name_prefix=name)
    self._futures: list[concurrent.futures.Future] = []

  def _raise_failures(self, block: bool) -> None:
    while self._futures and (block or self._futures[0].done()):
      self._futures.pop(0).result()

  def submit(self, nest: dict[str, Any], validate: Optional[Callable[[], None]],
             persist: Callable[[dict[str, Any]], None]) -> None:
    self._raise_failures(block=True)

    def finish():
      host_nest = devices.to_host(nest)
      if validate is not None:
        try:
          validate()
        except Exception:  # pylint: disable=broad-except  (the validator reports it)
          return
      persist(host_nest)

    self._futures.append(self._executor.submit(finish))

  def wait(self) -> None:
    self._raise_failures(block=True)


def restore_snapshot(state: ExperimentState, nest: dict[str, Any]) -> None:
  """Loads a snapshot (either jaxline layout) into `state`."""
  # Deferred: experiment imports this module's users, not the other way round.
  from jaxline_ng import experiment as experiment_lib

  for name, value in nest.items():
    if name == "experiment_module":
      module = state.experiment_module
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
        state.train_step_rng = rng.place_chain(value)
    else:
      setattr(state, name, value)


class InMemoryCheckpointer:
  """Keeps up to `max_checkpoints_to_keep` host-memory snapshots per series.

  `save` returns once the state's arrays are copied on device; the copy to
  host memory and the append to the series happen on a background thread
  (`wait_for_checkpointing_to_finish` waits for them), so saving costs the
  training loop a dispatch, not a pause.
  """

  def __init__(self, config, mode: str):
    del mode  # Series are shared by every mode in the process.
    self._max_checkpoints_to_keep = config.max_checkpoints_to_keep
    self._lock = threading.Lock()
    self._worker = SaveWorker("in_memory_checkpointer")

  def _series(self, ckpt_series: str) -> CheckpointNT:
    checkpoints = global_checkpoint_dict()
    with self._lock:
      if ckpt_series not in checkpoints:
        checkpoints[ckpt_series] = CheckpointNT(threading.local(), [])
      return checkpoints[ckpt_series]

  def get_experiment_state(self, ckpt_series: str) -> ExperimentState:
    active = self._series(ckpt_series).active
    if not hasattr(active, "state"):
      active.state = ExperimentState()
    return active.state

  def save(self, ckpt_series: str, *, validate: Optional[Callable[[], None]] = None) -> None:
    """Snapshots the live state of `ckpt_series`; `validate` may veto it (see SaveWorker)."""
    series = self._series(ckpt_series)

    def append(nest):
      with self._lock:
        next_id = series.history[-1].id + 1 if series.history else 0
        series.history.append(SnapshotNT(next_id, nest))
        del series.history[:-self._max_checkpoints_to_keep]
      logging.info("[jaxline_ng] Saved in-memory checkpoint %s/%d at step %d.",
                   ckpt_series, next_id, nest.get("global_step", -1))

    self._worker.submit(device_snapshot(self.get_experiment_state(ckpt_series)), validate,
                        append)

  def can_be_restored(self, ckpt_series: str) -> bool:
    series = global_checkpoint_dict().get(ckpt_series)
    return bool(series and series.history)

  def restore(self, ckpt_series: str) -> None:
    snapshot = self._series(ckpt_series).history[-1]
    restore_snapshot(self.get_experiment_state(ckpt_series), snapshot.pickle_nest)
    logging.info("[jaxline_ng] Restored in-memory checkpoint %s/%d.", ckpt_series, snapshot.id)

  def restore_path(self, ckpt_series: str) -> Optional[int]:
    if not self.can_be_restored(ckpt_series):
      return None
    return global_checkpoint_dict()[ckpt_series].history[-1].id

  def wait_for_checkpointing_to_finish(self) -> None:
    self._worker.wait()


def get_checkpoint_dir(config, host_id: int) -> str:
  """A directory for `host_id`'s own files under `config.checkpoint_dir`, created.

  Not in public jaxline, but published experiments call it to place files
  they write themselves (e.g. an exported best model).
  """
  path = os.path.join(config.checkpoint_dir, f"host_{host_id}")
  os.makedirs(path, exist_ok=True)
  return path
