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
import math
import os
import threading
import time
from typing import Any, Callable, Optional, Protocol

import jax
import numpy as np
from absl import logging

from jaxline_ng import devices
from jaxline_ng import guards
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
  (`devices.packed_first`: one dispatch, one buffer per number width; the first
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

  `submit(nest, validate, persist)` returns while, on the worker, `validate()`
  runs (it may wait for the step's outputs; if it raises, the save is
  dropped and the validator reports its own failure), the snapshot is
  copied to host memory (`devices.to_host`) and `persist(host_nest)`
  stores it. An error while persisting is raised on a caller's thread by
  the next `submit` or by `wait`.

  With `batch_seconds=0`, `submit` first waits for the previous save, so at
  most one snapshot waits on the devices. With `batch_seconds > 0`, saves
  made within that time of the previous batch wait and go together: one
  wake-up of the worker and one read for all their checks
  (`guards.run_in_order`), where a save every few steps would otherwise
  wake it and read each time, taking CPU from the devices. With `keep`, a
  save that `keep` newer saves of its batch would evict anyway is not
  copied to host: its `persist` gets None. Past `_MAX_PENDING` saves the
  submitter waits for the worker, which bounds the device memory pending
  snapshots take.
  """

  _MAX_PENDING = 64

  def __init__(self, name: str, *, batch_seconds: float = 0.0, keep: Optional[int] = None):
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                           thread_name_prefix=name)
    self._batch_seconds = batch_seconds
    self._keep = keep
    self._lock = threading.Lock()
    self._pending: list[tuple[dict[str, Any], Optional[Callable[[], None]], Callable]] = []
    self._running: Optional[concurrent.futures.Future] = None
    self._flush = threading.Event()
    self._failures: list[BaseException] = []

  def submit(self, nest: dict[str, Any], validate: Optional[Callable[[], None]],
             persist: Callable[[Optional[dict[str, Any]]], None]) -> None:
    if not self._batch_seconds or len(self._pending) >= self._MAX_PENDING:
      self.wait()
    else:
      self._raise_failure()
    with self._lock:
      self._pending.append((nest, validate, persist))
      if self._running is None:
        self._running = self._executor.submit(self._run)

  def wait(self) -> None:
    """Blocks until every save submitted so far is finished; raises a failure."""
    self._flush.set()
    try:
      while True:
        with self._lock:
          running = self._running
        if running is None:
          break
        running.result()
    finally:
      self._flush.clear()
    self._raise_failure()

  def _raise_failure(self) -> None:
    if self._failures:
      raise self._failures.pop(0)

  def _run(self) -> None:
    """The worker: takes batches until none is pending."""
    last_batch = -math.inf
    while True:
      delay = last_batch + self._batch_seconds - time.monotonic()
      if delay > 0:
        self._flush.wait(delay)
      with self._lock:
        batch, self._pending = self._pending, []
        if not batch:
          self._running = None
          return
      last_batch = time.monotonic()
      try:
        self._finish(batch)
      except Exception as e:  # pylint: disable=broad-except  (raised on the caller's thread)
        self._failures.append(e)

  def _finish(self, batch) -> None:
    passed = guards.run_in_order([validate for _, validate, _ in batch])
    stored = [(nest, persist) for (nest, _, persist), ok in zip(batch, passed) if ok]
    for index, (nest, persist) in enumerate(stored):
      superseded = self._keep is not None and len(stored) - index > self._keep
      try:
        persist(None if superseded else devices.to_host(nest))
      except Exception as e:  # pylint: disable=broad-except  (raised on the caller's thread)
        self._failures.append(e)


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
  training loop a dispatch, not a pause. Saves made less than
  `SAVE_BATCH_SECONDS` apart are appended together (see `SaveWorker`), so
  a new checkpoint shows in its series up to that long after `save`; one
  that newer saves of its batch push out of the series at once is counted
  (ids stay consecutive) but never copied to the host.
  """

  SAVE_BATCH_SECONDS = 0.1

  def __init__(self, config, mode: str):
    del mode  # Series are shared by every mode in the process.
    self._max_checkpoints_to_keep = config.max_checkpoints_to_keep
    self._lock = threading.Lock()
    # Per series, saves counted but not stored since the last stored one.
    self._superseded: collections.Counter[str] = collections.Counter()
    self._worker = SaveWorker("in_memory_checkpointer", batch_seconds=self.SAVE_BATCH_SECONDS,
                              keep=self._max_checkpoints_to_keep)

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

    def append(nest):  # On the worker, one save at a time.
      if nest is None:
        self._superseded[ckpt_series] += 1
        return
      with self._lock:
        next_id = ((series.history[-1].id + 1 if series.history else 0)
                   + self._superseded.pop(ckpt_series, 0))
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
