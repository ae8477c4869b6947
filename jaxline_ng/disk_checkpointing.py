"""Durable checkpoints on disk, with orbax-checkpoint.

Select with `config.checkpointer = "disk"`. Each series (`latest`, `best`)
lives in `<checkpoint_dir>/checkpoints/<series>/<step>/`, the newest
`max_checkpoints_to_keep` kept. A checkpoint holds:

- `arrays`: every array of the snapshot, written by orbax (tensorstore), and
- `meta`: JSON with the snapshot's plain Python values (ints, floats, bools,
  strings) and, for each entry, the list/dict/tuple skeleton it was made of.

Saving copies the state's arrays on device on the calling thread (fresh
buffers: donation and the steps dispatched next cannot change them) and
checks every value can be stored; copying to host memory and writing happen
on a background thread while training continues. The next save, the final
save and `wait_for_checkpointing_to_finish` wait for it. Orbax writes into a
temporary directory and renames it when complete, so a process killed at any
moment leaves only complete step directories (partial ones are removed when
the next run starts).

Restoring executes nothing from the checkpoint (no pickle): arrays come back
through orbax into the structure the experiment already has (NamedTuples,
optax states, haiku dicts), and plain Python values from JSON. A newest
checkpoint that fails to load is reported and the one before it is used.
"""

import logging as python_logging
import os
import threading
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from jaxline_ng import checkpointing
from jaxline_ng import devices
from jaxline_ng import multihost

_PLAIN_VALUES = (bool, int, float, str)


def _drop_orbax_info(record: python_logging.LogRecord) -> bool:
  """Orbax logs each phase of every save at INFO; jaxline_ng logs saves itself."""
  return record.levelno >= python_logging.WARNING or \
      f"{os.sep}orbax{os.sep}" not in record.pathname


logging.get_absl_logger().addFilter(_drop_orbax_info)


class CheckpointFormatError(TypeError):
  """A snapshot value that cannot be stored without pickle; names the entry."""


def _entry_name(top_key: str, path) -> str:
  return top_key + jax.tree_util.keystr(path)


def _skeleton(value: Any) -> Any:
  """A JSON description of plain containers, or None if `value` has other nodes.

  Leaves become {"leaf": i} (their index among the entry's leaves), so the
  skeleton plus the leaves rebuild the value without knowing its type.
  """
  counter = iter(range(1 << 62))

  def describe(node):
    if node is None:
      return {"none": True}
    if isinstance(node, dict):
      if not all(isinstance(k, str) for k in node):
        raise TypeError
      return {"dict": {k: describe(node[k]) for k in sorted(node)}}
    if type(node) in (list, tuple):
      return {type(node).__name__: [describe(v) for v in node]}
    if isinstance(node, (np.ndarray, np.generic, *_PLAIN_VALUES)):
      return {"leaf": next(counter)}
    raise TypeError

  try:
    return describe(value)
  except TypeError:
    return None


def _rebuild(skeleton: Any, leaves: list) -> Any:
  if "none" in skeleton:
    return None
  if "leaf" in skeleton:
    return leaves[skeleton["leaf"]]
  if "dict" in skeleton:
    return {k: _rebuild(v, leaves) for k, v in skeleton["dict"].items()}
  if "list" in skeleton:
    return [_rebuild(v, leaves) for v in skeleton["list"]]
  return tuple(_rebuild(v, leaves) for v in skeleton["tuple"])


_MODULE_PREFIX = "experiment_module/"


def _named_entries(nest: dict[str, Any]) -> dict[str, Any]:
  """A snapshot as flat entries: its own values by name, the experiment's as
  `experiment_module/<checkpoint name>`."""
  module = nest.get("experiment_module") or {}
  return {**{k: v for k, v in nest.items() if k != "experiment_module"},
          **{_MODULE_PREFIX + k: v for k, v in module.items()}}


def _unstorable(name: str, path, leaf: Any) -> CheckpointFormatError:
  return CheckpointFormatError(
      f"cannot checkpoint {_entry_name(name, path)}: a {type(leaf).__name__} is "
      "neither an array nor a plain Python value (int, float, bool, str)")


def check_storable(nest: dict[str, Any]) -> None:
  """Raises CheckpointFormatError naming the first value `encode` could not store.

  Cheap (no copies), so a save can fail on the caller's thread, at once.
  """
  for name, value in _named_entries(nest).items():
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
      if not isinstance(leaf, (jax.Array, devices.DeferredHostValue, np.ndarray, np.generic,
                               *_PLAIN_VALUES)):
        raise _unstorable(name, path, leaf)


def encode(nest: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Splits a host snapshot into orbax arrays and JSON metadata.

  Raises CheckpointFormatError naming the first value that is neither an
  array nor a plain Python value.
  """
  arrays, entries = {}, {}
  for name, value in _named_entries(nest).items():
    leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(value)
    leaves = []
    for path, leaf in leaves_with_paths:
      if isinstance(leaf, (np.ndarray, np.generic)):
        key = str(len(arrays))
        arrays[key] = np.asarray(leaf)
        leaves.append({"array": key})
      elif isinstance(leaf, _PLAIN_VALUES):
        leaves.append({"value": leaf})
      else:
        raise _unstorable(name, path, leaf)
    entries[name] = {"leaves": leaves, "skeleton": _skeleton(value)}
  return arrays, {"format": 1, "entries": entries}


def decode(arrays: dict[str, np.ndarray], meta: dict[str, Any],
           live_nest: dict[str, Any]) -> dict[str, Any]:
  """Rebuilds a snapshot, in the structure of `live_nest` where it has one."""
  live = _named_entries(live_nest)
  nest: dict[str, Any] = {}
  for name, entry in meta["entries"].items():
    if name.startswith(_MODULE_PREFIX) and "experiment_module" not in live_nest:
      continue  # The caller restores only the run's own values (e.g. the best metric).
    leaves = [arrays[leaf["array"]] if "array" in leaf else leaf["value"]
              for leaf in entry["leaves"]]
    live_treedef = jax.tree.structure(live[name]) if name in live else None
    if entry["skeleton"] is not None:
      value = _rebuild(entry["skeleton"], leaves)
      # Same leaves, other node types (a NamedTuple saved as a tuple): take the live ones.
      if live_treedef is not None and live_treedef.num_leaves == len(leaves) and \
          live_treedef != jax.tree.structure(value):
        value = jax.tree.unflatten(live_treedef, leaves)
    elif live_treedef is not None and live_treedef.num_leaves == len(leaves):
      value = jax.tree.unflatten(live_treedef, leaves)
    else:
      raise CheckpointFormatError(
          f"checkpoint entry {name} has {len(leaves)} leaves but the experiment's "
          f"has {None if live_treedef is None else live_treedef.num_leaves}")
    if name.startswith(_MODULE_PREFIX):
      nest.setdefault("experiment_module", {})[name[len(_MODULE_PREFIX):]] = value
    else:
      nest[name] = value
  return nest


def _steps(series_dir: str) -> list[int]:
  """Complete checkpoints of a series, oldest first (orbax's temp dirs are not numbers)."""
  if not os.path.isdir(series_dir):
    return []
  return sorted(int(name) for name in os.listdir(series_dir) if name.isdigit())


def _restore_args() -> ocp.args.Composite:
  return ocp.args.Composite(arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())


def read(checkpoint_dir: str, series: str = "latest",
         step: Optional[int] = None) -> tuple[int, dict[str, Any]]:
  """Reads a checkpoint without an experiment: `(step, snapshot)`.

  For scripts (exporting weights, comparing runs). Entries made of plain
  containers come back as dicts/lists/tuples; others (NamedTuples, optax
  states) as the list of their leaves in tree order. `step` defaults to the
  newest.
  """
  series_dir = os.path.join(checkpoint_dir, "checkpoints", series)
  steps = _steps(series_dir)
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {series_dir}")
  step = steps[-1] if step is None else step
  restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
      os.path.abspath(os.path.join(series_dir, str(step))), args=_restore_args())
  entries = restored["meta"]["entries"]
  live = {"experiment_module": {}}
  for name, entry in entries.items():
    if entry["skeleton"] is None:  # Without a live structure: a flat list of leaves.
      top, _, attr = name.partition("/")
      placeholder = [0] * len(entry["leaves"])
      if attr:
        live["experiment_module"][attr] = placeholder
      else:
        live[top] = placeholder
  return step, decode(restored["arrays"], restored["meta"], live)


class _CheckpointManager(ocp.CheckpointManager):
  """orbax's manager, kept from asking JAX's preemption sync point.

  The sync point counts steps from the calls made to it, and orbax asks it
  about each step it saves, on the save worker, after the loop has moved on:
  a notice arriving then would have this process report a step the loop has
  passed, and the processes could agree on a step it never reaches. The
  loop alone asks (`preemption.StopCheck`) and saves the agreed step itself.
  """

  def reached_preemption(self, step: int) -> bool:
    del step
    return False


class DiskCheckpointer:
  """The Checkpointer protocol over orbax step directories."""

  def __init__(self, config, mode: str):
    del mode  # Train and eval processes share the series.
    # Every process restores the chief's checkpoints (a shared filesystem is
    # assumed), so all resume at the same step. Processes that save besides
    # the chief (*_checkpoint_all_hosts) each write to a tree of their own.
    self._read_root = os.path.join(config.checkpoint_dir, "checkpoints")
    self._root = self._read_root
    if not multihost.is_chief():
      self._root = os.path.join(self._read_root, f"process_{jax.process_index()}")
    self._max_to_keep = config.max_checkpoints_to_keep
    self._restore_path = config.restore_path
    self._live = threading.local()
    self._managers: dict[str, ocp.CheckpointManager] = {}
    self._lock = threading.Lock()
    self._reader = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    self._worker = checkpointing.SaveWorker("disk_checkpointer")

  def _series_dir(self, ckpt_series: str) -> str:
    return os.path.join(self._root, ckpt_series)

  def _manager(self, ckpt_series: str) -> ocp.CheckpointManager:
    with self._lock:
      if ckpt_series not in self._managers:
        # Each saving process acts alone (only the chief saves by default),
        # so orbax must not wait for the others at a barrier; it then leaves
        # creating the directory to us.
        os.makedirs(self._series_dir(ckpt_series), exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self._max_to_keep,
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
            create=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=jax.process_index(), active_processes={jax.process_index()}))
        self._managers[ckpt_series] = _CheckpointManager(
            self._series_dir(ckpt_series), options=options)
      return self._managers[ckpt_series]

  def get_experiment_state(self, ckpt_series: str) -> checkpointing.ExperimentState:
    states = self._live.__dict__.setdefault("states", {})
    return states.setdefault(ckpt_series, checkpointing.ExperimentState())

  def save(self, ckpt_series: str, *, validate: Optional[Callable[[], None]] = None) -> None:
    """Snapshots the live state on device now; writes it on the save worker.

    The worker copies it to host, runs `validate` (which may veto the save),
    encodes it and has orbax write it; the next save and
    `wait_for_checkpointing_to_finish` wait for that.
    """
    state = self.get_experiment_state(ckpt_series)
    manager = self._manager(ckpt_series)
    nest = checkpointing.device_snapshot(state)
    check_storable(nest)
    step = state.global_step

    def write(host_nest):
      if manager.latest_step() == step:
        return  # Saved already (a final save right after a periodic one).
      arrays, meta = encode(host_nest)
      manager.save(step, args=ocp.args.Composite(
          arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))
      manager.wait_until_finished()
      logging.info("[jaxline_ng] Saved checkpoint %s/%d to %s.", ckpt_series, step,
                   self._series_dir(ckpt_series))

    self._worker.submit(nest, validate, write)

  def _candidates(self, ckpt_series: str) -> list[str]:
    """Step directories to restore from, newest first; `restore_path` for a fresh `latest`."""
    series_dir = os.path.join(self._read_root, ckpt_series)
    paths = [os.path.join(series_dir, str(step)) for step in reversed(_steps(series_dir))]
    if not paths and ckpt_series == "latest" and self._restore_path:
      steps = _steps(self._restore_path)
      paths = ([os.path.join(self._restore_path, str(steps[-1]))] if steps
               else [self._restore_path])
    return paths

  def can_be_restored(self, ckpt_series: str) -> bool:
    return bool(self._candidates(ckpt_series))

  def restore_path(self, ckpt_series: str) -> Optional[str]:
    candidates = self._candidates(ckpt_series)
    return candidates[0] if candidates else None

  def restore(self, ckpt_series: str) -> None:
    state = self.get_experiment_state(ckpt_series)
    fresh_run = not _steps(os.path.join(self._read_root, ckpt_series))
    failures = []
    for path in self._candidates(ckpt_series):
      try:
        restored = self._reader.restore(os.path.abspath(path), args=_restore_args())
        live = state.snapshotted_items()
        if state.experiment_module is not None:
          live["experiment_module"] = state.experiment_module.snapshot_state()
        nest = decode(restored["arrays"], restored["meta"], live)
      except Exception as e:  # pylint: disable=broad-except  (any damage: try the previous one)
        logging.warning("[jaxline_ng] Checkpoint %s could not be loaded (%s: %s); "
                        "trying the previous one.", path, type(e).__name__, e)
        failures.append(path)
        continue
      if fresh_run and ckpt_series == "latest":
        # `restore_path` seeds a new run: its weights, not its step or keys.
        nest = {"experiment_module": nest.get("experiment_module", {})}
      checkpointing.restore_snapshot(state, nest)
      logging.info("[jaxline_ng] Restored checkpoint %s.", path)
      return
    raise FileNotFoundError(
        f"no loadable checkpoint for series {ckpt_series!r}; tried {failures}")

  def wait_for_checkpointing_to_finish(self) -> None:
    self._worker.wait()
