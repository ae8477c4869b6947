"""Durable checkpoints on disk, as native orbax checkpoints: `DiskCheckpointer`.

Each series lives in `<checkpoint_dir>/checkpoints/<series>/<step>/` (items:
`checkpoint_format`; reading: `checkpoint_restore`). A save dispatches
checksums and runs the non-finite check on the calling thread, then orbax's
async save copies the arrays to the host and writes them on its thread, into a
temporary directory renamed when complete; its `LatestN` keeps the newest. A
damaged checkpoint is reported, the one before used, and the bad one moved
aside (`<series>.unusable/`); one that does not fit the experiment is refused.
"""

import contextlib
import logging as python_logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from jaxline_ng import (
  checkpoint_format,
  checkpoint_restore,
  checkpointing,
  devices,
  multihost,
  rng,
)
from jaxline_ng import mesh as mesh_lib
from jaxline_ng.checkpoint_dir import (
  CheckpointWriteError,
  check_checkpoint_dir,
  check_writable,
  os_error_code,
)
from jaxline_ng.checkpoint_fingerprints import dispatch_fingerprints, fingerprints_on_host
from jaxline_ng.checkpoint_fit import live_layout
from jaxline_ng.checkpoint_format import (
  DROP_EXTRA_KEY,
  FORMAT,
  META_ITEM,
  STATE_ITEM,
  CheckpointFormatError,
  CheckpointRefused,
  DoesNotFit,
  UnusableCheckpoint,
  digest,
  encode,
  saved_steps,
  unusable_dir,
  warn_if_another_topology,
  with_peer_positions,
)
from jaxline_ng.checkpoint_restore import orbax_processes, read

# What scripts and the platform use; the format and restoring live in the modules above.
__all__ = ["DROP_EXTRA_KEY", "FORMAT", "CheckpointFormatError", "CheckpointRefused",
           "CheckpointWriteError", "DiskCheckpointer", "UnusableCheckpoint",
           "check_checkpoint_dir", "encode", "read", "unusable_dir"]


def _drop_orbax_info(record: python_logging.LogRecord) -> bool:
  """Drops orbax's INFO lines from absl's logger (a dozen a save; jaxline_ng logs one)."""
  return record.levelno >= python_logging.WARNING or \
      f"{os.sep}orbax{os.sep}" not in record.pathname


class _CheckpointManager(ocp.CheckpointManager):
  """orbax's manager, kept from asking JAX's preemption sync point: it would report
  steps from its finalize thread after the loop moved on, and the processes could
  agree on a step the loop never reaches. The loop alone asks (`preemption.StopCheck`)."""

  def reached_preemption(self, step: int) -> bool:
    del step
    return False


def _as_orbax_takes_them(tree: dict[str, Any]) -> dict[str, Any]:
  """The arrays of a snapshot as orbax is to record them: in pmap mode host copies (a
  recorded sharding would tie the checkpoint to as many devices); mesh-mode global
  arrays as they are, but one-device arrays (orbax refuses them across processes)."""
  if mesh_lib.placement().per_device:
    return jax.device_get(tree)
  return jax.tree.map(lambda x: jax.device_get(x) if isinstance(x, jax.Array) and len(
      x.sharding.device_set) == 1 and len(jax.devices()) > 1 else x, tree)


class DiskCheckpointer(checkpointing.Checkpointer):
  """A Checkpointer over orbax step directories."""

  validates_saves = True
  keeps_run_entries = True
  restores_saved_entries = True
  restores_by_path = True

  def __init__(self, config, mode: str):
    check_checkpoint_dir(config.checkpoint_dir)
    logging.get_absl_logger().addFilter(_drop_orbax_info)  # Once: addFilter skips repeats.
    self._mode = mode
    self._writes = {"latest"} if mode in ("train", "train_eval_multithreaded") else {"best"}
    if mode == "train_eval_multithreaded":
      self._writes.add("best")
    # Every process reads the chief's tree; in pmap mode others that save write their
    # own, in mesh mode every process writes its shards into the chief's.
    self._read_root = os.path.join(config.checkpoint_dir, "checkpoints")
    self._root = self._read_root
    self.every_process_saves = config.placement == "mesh" and jax.process_count() > 1
    if not multihost.is_chief() and not self.every_process_saves:
      self._root = os.path.join(self._read_root, f"process_{jax.process_index()}")
    self._max_to_keep = config.max_checkpoints_to_keep
    self._drop_extra = config.get(DROP_EXTRA_KEY, False)  # A config of jaxline's keys lacks it.
    self._restore_path = config.restore_path
    self._live = threading.local()
    self._managers: dict[str, ocp.CheckpointManager] = {}
    self._lock = threading.Lock()
    self._pending: dict[str, int] = {}  # The step of each series orbax is writing.
    self._failure: BaseException | None = None  # A failed save's error, raised from then on.
    self.unloadable_newer: list[str] = []
    self.started_from: str | None = None
    for ckpt_series in self._writes:  # Now, not at the first save, minutes of training later.
      check_writable(self._series_dir(ckpt_series))

  def _series_dir(self, ckpt_series: str, root: str | None = None) -> str:
    """Where `ckpt_series` is written (read, from `self._read_root`); an `eval_<name>`
    job's `best` is `best_<name>`, as evaluators side by side evaluate other data."""
    if ckpt_series == "best" and self._mode.startswith("eval_"):
      ckpt_series = "best_" + self._mode[len("eval_"):]
    return os.path.join(root or self._root, ckpt_series)

  def _manager(self, ckpt_series: str) -> ocp.CheckpointManager:
    with self._lock:
      if ckpt_series not in self._managers:
        processes = orbax_processes(together=self.every_process_saves)
        # Made here: orbax would wait for every process at a barrier first.
        os.makedirs(self._series_dir(ckpt_series), exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(self._max_to_keep),
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
            create=False,
            multiprocessing_options=processes)
        # Uncompressed: zstd spends more CPU per save and restore than its disk saving is worth.
        handlers = {META_ITEM: ocp.JsonCheckpointHandler(multiprocessing_options=processes),
                    STATE_ITEM: ocp.PyTreeCheckpointHandler(
                        use_compression=False, multiprocessing_options=processes)}
        self._managers[ckpt_series] = _CheckpointManager(
            self._series_dir(ckpt_series), options=options, item_handlers=handlers)
      return self._managers[ckpt_series]

  def get_experiment_state(self, ckpt_series: str) -> ml_collections.ConfigDict:
    states = self._live.__dict__.setdefault("states", {})
    if ckpt_series not in states:
      states[ckpt_series] = checkpointing.new_state()
    return states[ckpt_series]

  def save(self, ckpt_series: str, *, validate: Callable[[], None] | None = None) -> None:
    """Saves the live state as a step of `ckpt_series`, with orbax's asynchronous save.

    `validate` runs after the checksums are dispatched; if it raises, nothing is
    saved. A failed write fails the checkpointer for good: every later save and
    wait raises its error.
    """
    self.wait_for_checkpointing_to_finish()
    state = self.get_experiment_state(ckpt_series)
    manager = self._manager(ckpt_series)
    step = state.global_step
    if manager.latest_step() == step:  # Saved already (a final save right after a periodic one).
      if ckpt_series != "latest":  # A best step an earlier evaluator saved (another metric's).
        logging.warning("[jaxline_ng] %s/%d is saved already: kept as it is.", ckpt_series, step)
      return
    tree, entries, arrays = encode(checkpointing.device_snapshot(state, fresh=False))
    fingerprints = dispatch_fingerprints([array for _, array in arrays])
    if validate is not None:
      try:
        validate()
      except Exception:  # pylint: disable=broad-except  (the guard reports its own failure)
        logging.warning("[jaxline_ng] Not saving %s/%d: the checks before saving it failed "
                        "(see above).", ckpt_series, step)
        return
    # The chief's training saves hold every process's data positions.
    if (multihost.is_multiprocess() and multihost.is_chief() and ckpt_series == "latest"
        and ckpt_series in self._writes):
      entries = with_peer_positions(entries, step)
    meta = {"format": FORMAT, "step": step, "topology": checkpoint_format.current_topology(),
            "entries": entries,
            "arrays": {"/".join(path): {"shape": list(np.shape(array)),
                                        "dtype": np.dtype(array.dtype).name,
                                        "fingerprint": fingerprint}
                       for (path, array), fingerprint in zip(
                           arrays, fingerprints_on_host(fingerprints))}}
    meta["digest"] = digest(meta)
    items = {META_ITEM: ocp.args.JsonSave(meta)}
    if tree:
      items[STATE_ITEM] = ocp.args.PyTreeSave(_as_orbax_takes_them(tree))
    series_dir = self._series_dir(ckpt_series)
    self._unlink_links_rotated_out(series_dir, step)
    with self._lock:
      self._pending[ckpt_series] = step
    with self._failing_for_good(ckpt_series):
      if not manager.save(step, args=ocp.args.Composite(**items)):
        raise RuntimeError(f"orbax did not save step {step} in {series_dir} (it holds step "
                           f"{manager.latest_step()}): move the newer step directories away "
                           "to save there")

  @contextlib.contextmanager
  def _failing_for_good(self, ckpt_series: str):
    """Keeps a failed write's error for later calls; a filesystem's refusal becomes a
    CheckpointWriteError naming the directory."""
    try:
      yield
    except (OSError, ValueError) as e:
      code = os_error_code(e)
      if code is None and not isinstance(e, OSError):
        self._failure = e
        raise
      reason = os.strerror(code) if code else e
      self._failure = CheckpointWriteError(
          code, f"cannot save step {self._pending[ckpt_series]} in "
          f"{self._series_dir(ckpt_series)}: {reason}")
      raise self._failure from e
    except Exception as e:
      self._failure = e
      raise

  def _finish(self, ckpt_series: str) -> None:
    """Waits for orbax to write `ckpt_series`'s pending step (if any), and logs it."""
    with self._lock:
      manager, step = self._managers.get(ckpt_series), self._pending.get(ckpt_series)
    if manager is None or step is None:
      return
    with self._failing_for_good(ckpt_series):
      manager.wait_until_finished()
    with self._lock:
      self._pending.pop(ckpt_series, None)
    logging.info("[jaxline_ng] Saved checkpoint %s/%d to %s.", ckpt_series, step,
                 self._series_dir(ckpt_series))

  def _unlink_links_rotated_out(self, series_dir: str, step: int) -> None:
    """Removes the symbolic links among the step directories saving `step` rotates out,
    never their targets, which orbax would delete through or fail on."""
    if not (multihost.is_chief() or not self.every_process_saves):
      return  # The chief rotates the one tree every process writes to.
    for old_step in sorted({*saved_steps(series_dir), step})[:-self._max_to_keep]:
      path = os.path.join(series_dir, str(old_step))
      if os.path.islink(path):
        target = os.readlink(path)
        os.unlink(path)
        logging.warning("[jaxline_ng] Rotated out step %d: removed the symbolic link %s (its "
                        "target %s is kept).", old_step, path, target)

  def _candidates(self, ckpt_series: str) -> list[str]:
    """Step directories to restore from, newest first; `restore_path` for a fresh `latest`."""
    series_dir = self._series_dir(ckpt_series, self._read_root)
    paths = [os.path.join(series_dir, str(step)) for step in reversed(saved_steps(series_dir))]
    if not paths and ckpt_series == "latest" and self._restore_path:
      # Another run's series, or its checkpoint_dir; else a step directory.
      for series_dir in (self._restore_path,
                         os.path.join(self._restore_path, "checkpoints", "latest")):
        steps = saved_steps(series_dir)
        if steps:  # All of them: a damaged one is reported and the one before it used.
          return [os.path.join(series_dir, str(step)) for step in reversed(steps)]
      paths = [self._restore_path]
    return paths

  def can_be_restored(self, ckpt_series: str) -> bool:
    return bool(self._candidates(ckpt_series))

  def restore_path(self, ckpt_series: str) -> str | None:
    candidates = self._candidates(ckpt_series)
    return candidates[0] if candidates else None

  def restore(self, ckpt_series: str, path: str | None = None) -> None:
    """Loads the newest usable checkpoint of `ckpt_series`, or the one at `path`.

    Newer ones that fail are reported and, by the process writing the series,
    moved aside once an older one has loaded.

    Args:
      ckpt_series: the series, e.g. "latest".
      path: a step directory `restore_path` returned (the chief's choice), and no other.

    Raises:
      CheckpointRefused: when none can be used.
    """
    candidates = [path] if path is not None else self._candidates(ckpt_series)
    state = self.get_experiment_state(ckpt_series)
    fresh_run = not saved_steps(self._series_dir(ckpt_series, self._read_root))
    live = devices.raw_keys(checkpointing.snapshotted_items(state))
    if getattr(state, "experiment_module", None) is not None:
      live["experiment_module"] = live_layout(state.experiment_module)
    # The experiment's own mode where it keeps one: an evaluator may share the trainer's.
    training = getattr(getattr(state, "experiment_module", None), "mode", self._mode) == "train"
    failures = []
    for position, candidate in enumerate(candidates):
      try:
        nest, topology = checkpoint_restore.load(candidate, live, agree=self.every_process_saves,
                               training=training, drop_extra=self._drop_extra)
      except DoesNotFit as e:
        seeding = fresh_run and ckpt_series == "latest" and self._restore_path
        where = f"config.restore_path={self._restore_path!r}: " if seeding else ""
        hint = ", or a new checkpoint_dir" if training and not seeding else ""
        raise CheckpointRefused(
            f"{where}checkpoint {candidate} does not fit the experiment: {e} (if its code "
            f"has changed since, use the code that saved it{hint})") from None
      except CheckpointRefused:
        raise
      except (UnusableCheckpoint, KeyError, TypeError, IndexError, AttributeError) as e:
        logging.warning("[jaxline_ng] Checkpoint %s could not be loaded: %s%s", candidate, e,
                        "; trying the previous one." if position + 1 < len(candidates) else ".")
        failures.append((candidate, e))
        continue
      if nest["global_step"] > rng.MAX_STEP:
        raise CheckpointRefused(
            f"checkpoint {candidate} is at step {nest['global_step']}, beyond {rng.MAX_STEP}, "
            "the most steps a step's int32 global_step counts (as in jaxline)")
      starting = fresh_run and ckpt_series == "latest"
      if starting:  # From the other run's step and state, not its config and saving clock.
        nest = {name: value for name, value in nest.items()
                if name not in ("run_config", "periodic_action_times")}
        if training:
          self.started_from = candidate
      if training:  # An evaluation takes no key from the chain.
        warn_if_another_topology(topology, nest["global_step"])
        if not starting and ckpt_series == "latest" and self._restore_path:  # New runs only.
          logging.warning("[jaxline_ng] config.restore_path=%r is not read: the run resumes its "
                          "own checkpoint %s.", self._restore_path, candidate)
      if not fresh_run:
        self._move_aside([p for p, _ in failures], ckpt_series)
      self.unloadable_newer = [p for p, _ in failures]
      checkpointing.restore_snapshot(state, nest)
      if starting and training:
        logging.info("[jaxline_ng] Started from config.restore_path's checkpoint %s (step %d); "
                     "this run saves to %s.", candidate, state.global_step,
                     self._series_dir(ckpt_series))
      else:
        logging.info("[jaxline_ng] Restored checkpoint %s.", candidate)
      return
    if not failures:
      raise CheckpointRefused(f"no checkpoint for series {ckpt_series!r} in {self._read_root}")
    # A reader of a series another job writes may have lost a race with its rotation.
    if ckpt_series not in self._writes and (path is not None or not multihost.is_multiprocess()):
      newest_failed = os.path.basename(failures[0][0])
      steps_now = saved_steps(self._series_dir(ckpt_series, self._read_root))
      if newest_failed.isdigit() and steps_now and steps_now[-1] > int(newest_failed):
        raise checkpointing.CheckpointSuperseded(
            f"{failures[0][0]} did not load ({failures[0][1]}) and step {steps_now[-1]} has "
            "been saved since, rotating older ones out")
    if fresh_run and ckpt_series == "latest" and self._restore_path:
      raise CheckpointRefused(f"config.restore_path={self._restore_path!r}: {failures[0][1]}")
    raise CheckpointRefused(
        f"no usable checkpoint for series {ckpt_series!r}: {failures[0][0]}: {failures[0][1]}"
        + (f" (and {len(failures) - 1} older ones)" if len(failures) > 1 else ""))

  def _move_aside(self, paths: list[str], ckpt_series: str) -> None:
    """Moves unusable step directories out of the series, so saves go past their steps."""
    if ckpt_series not in self._writes or not multihost.is_chief():
      return
    for path in paths:
      target_dir = unusable_dir(os.path.dirname(path))
      os.makedirs(target_dir, exist_ok=True)
      moved_at = time.strftime("%Y%m%dT%H%M%S")
      target = os.path.join(target_dir, f"{os.path.basename(path)}-{moved_at}")
      os.rename(path, target)
      logging.warning("[jaxline_ng] Moved the unusable checkpoint %s to %s (kept for "
                      "inspection; saving continues past its step).", path, target)

  def set_aside(self, ckpt_series: str) -> bool:
    """Moves the series this process writes aside, kept beside it (the chief's, where
    every process writes into it, the others waiting for that)."""
    self._finish(ckpt_series)  # Not moved while orbax writes into it.
    series_dir = self._series_dir(ckpt_series)  # The chief's, or a process's own tree.
    if (multihost.is_chief() or not self.every_process_saves) and os.path.isdir(series_dir):
      target = f"{series_dir.rstrip(os.sep)}.earlier-{time.strftime('%Y%m%dT%H%M%S')}"
      os.rename(series_dir, target)
      logging.warning("[jaxline_ng] Moved %s to %s.", series_dir, target)
    if self.every_process_saves:
      multihost.rendezvous(f"jaxline_ng_set_aside_{ckpt_series}")
    with self._lock:
      self._managers.pop(ckpt_series, None)
    return True

  def wait_for_checkpointing_to_finish(self) -> None:
    """Blocks until every save started so far is on disk; raises a failed save's error."""
    if self._failure is not None:
      raise self._failure
    for ckpt_series in list(self._pending):
      self._finish(ckpt_series)
