"""The training loop's own periodic actions: checks after the first step, the
progress line, writing scalars, and periodic saves (where they wait: `train_loop`)."""

import math
import time
from collections.abc import Mapping
from typing import Any

from absl import logging

from jaxline_ng import checkpointing, guards, iterator_state, multihost, periodic, writers
from jaxline_ng import experiment as experiment_lib
from jaxline_ng import scalars as scalars_lib


class DifferingCopies:
  """Warns, once per entry, of CHECKPOINT_ATTRS whose copies differ between devices,
  after the first step and at the first save (state synced every few steps agrees at first)."""

  def __init__(self, experiment: Any | None):
    self._experiment = experiment  # None where this process does not save.
    self._warned: set[str] = set()
    self._looked_at_a_save = False

  def look_at_the_first_save(self, step: int) -> None:
    if not self._looked_at_a_save:
      self._looked_at_a_save = True
      self.look(f"at the first save (step {step})")

  def look(self, when: str) -> None:
    if self._experiment is None:
      return
    for attr in experiment_lib.differing_copies(self._experiment):
      if attr not in self._warned:
        self._warned.add(attr)
        logging.warning(
            "[jaxline_ng] CHECKPOINT_ATTRS entry %r differs between devices %s: checkpoints "
            "keep device 0's copy (as jaxline's did), so a resumed run is not exact. Average it "
            "over devices (haiku's BatchNorm: cross_replica_axis) or list it in "
            "NON_BROADCAST_CHECKPOINT_ATTRS.", attr, when)


class FirstStepChecks(periodic.EveryStepAction):
  """Stops the run after its first step if what `step` returned cannot be logged or
  CHECKPOINT_ATTRS cannot be saved, not at the first write or save a run later.

  First of all actions; later steps' outputs are checked where logging reads them.
  """

  def __init__(self, experiment: Any | None, differing_copies: DifferingCopies):
    self._experiment = experiment  # None where this process does not save.
    self._differing_copies = differing_copies
    self._done = False

  def __call__(self, t: float, step: int, scalars: Any) -> None:
    del t, step
    if self._done:
      return
    self._done = True
    scalars_lib.check_scalars([scalars], "step()")
    if self._experiment is not None:
      problem = experiment_lib.checkpoint_attrs_problem(self._experiment)
      if problem:
        raise experiment_lib.CheckpointAttrsError(problem)
      self._differing_copies.look("after the first step")


def interval_type(config, specific_key: str) -> str:
  return config[specific_key] or config.interval_type


def _progress_line(step: int, training_steps: int | None, scalars: Mapping[str, Any],
                   eta: bool = True) -> str:
  """"step 120/1000 (12.0%), 85.1 steps/s, ETA 0:00:10 | loss=0.31"; no ETA unless `eta`."""
  scalars = dict(scalars)
  steps_per_sec = scalars.pop("steps_per_sec", None)
  parts = [f"step {step}"]
  if training_steps:
    parts[0] += f"/{training_steps} ({100.0 * step / training_steps:.1f}%)"
  if steps_per_sec:
    parts.append(f"{steps_per_sec:.1f} steps/s")
    if training_steps and eta:
      left = (training_steps - step) / steps_per_sec
      if math.isfinite(left):
        minutes, secs = divmod(int(left), 60)
        parts.append(f"ETA {minutes // 60}:{minutes % 60:02d}:{secs:02d}")
      else:
        parts.append("ETA ?")
  compact = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in sorted(scalars.items()))
  return "[jaxline_ng] " + ", ".join(parts) + (f" | {compact}" if compact else "")


class _LoggingAction(periodic.PeriodicAction):
  """Logging and writing: `fn` gets host numbers, read from the first device's copy."""

  def _to_host(self, scalars):
    return scalars_lib.host_scalars_of_steps(scalars)


class _SaveAction(periodic.PeriodicAction):
  """Periodic saving: reads no scalars, and leaves the last step to `train`'s final save."""

  def _act_on(self, due):
    for step, _, _ in due:
      self._fn(step, None)

  def finish(self) -> None:
    self.wait_to_finish()


def default_periodic_actions(config, checkpointer: checkpointing.Checkpointer,
                             writer: writers.RunWriter | None, state,
                             save_checkpoints: bool,
                             guard: guards.NonFiniteGuard,
                             differing_copies: DifferingCopies,
                             peer_checks: guards.PeerChecks | None = None,
                             peer_positions: iterator_state.PeerPositions | None = None):
  """The non-finite guard, logging to absl, writing scalars, periodic checkpointing.

  The guard sees what logging and writing read, and checks the newest step
  before each save. Saving resumes its clock from the checkpoint's
  `periodic_action_times`.

  Returns:
    `({name: action}, save_latest)`, the latter also the final save.
  """
  start_step = state.global_step
  times = getattr(state, "periodic_action_times", None) if checkpointer.keeps_run_entries else None
  saved_at_time, saved_at_step = (times or {}).get("checkpoint", (time.time(), start_step))
  logging_type = interval_type(config, "logging_interval_type")
  growth = config.periodic_action_growth_ratios if logging_type == "steps" else None
  actions = {"non_finite_guard": guard}

  # The total and ETA only where `training_steps`, not an override, ends the run.
  module = state.experiment_module
  ends_at = (config.training_steps if type(module).should_run_step
             is experiment_lib.AbstractExperiment.should_run_step else None)

  first_line = True

  def log_progress(step, values):
    nonlocal first_line
    guard.observe(step, values)
    # The first rate includes compiling the step: an ETA from it is far off.
    logging.info(_progress_line(step, ends_at, values, eta=not first_line))
    first_line = False

  # The first rate is measured from here, as jaxline's (compilation included).
  actions["log"] = _LoggingAction(
      log_progress, logging_type, config.log_tensors_interval, start_time=None,
      start_step=start_step, logging_growth_ratios=growth)

  # As in jaxline, only the chief's scalars unless `log_all_hosts`.
  if (writer is not None and config.log_train_data_interval is not None
      and (multihost.is_chief() or config.log_all_hosts)):

    def write_scalars(step, values):
      guard.observe(step, values)
      writer.write_scalars(step, values)

    actions["write"] = _LoggingAction(
        write_scalars, logging_type, config.log_train_data_interval,
        start_time=None, start_step=start_step, log_all_data=config.log_all_train_data,
        logging_growth_ratios=growth)

  saved_at = [None]
  durable = writer is not None and not isinstance(checkpointer, checkpointing.InMemoryCheckpointer)

  def save_latest(step=None, scalars=None):
    del step, scalars
    if saved_at[0] == state.global_step:
      return  # The final save right after a periodic one at the same step.
    if peer_positions is not None:
      peer_positions.at_save(state.experiment_module, state.global_step)
    if not save_checkpoints:  # A process that only hands its data positions to the chief.
      saved_at[0] = state.global_step
      return
    if "checkpoint" in actions and checkpointer.keeps_run_entries:
      state.periodic_action_times = {"checkpoint": actions["checkpoint"].last_acted}
    if durable:
      flush_metrics(actions.get("write"), writer, config.log_all_train_data)
    if state.global_step > start_step:  # Not an initial save, before any step.
      differing_copies.look_at_the_first_save(state.global_step)
    if checkpointer.validates_saves:  # It dispatches its copies first, then waits in the guard.
      checkpointer.save("latest", validate=guard.seal(
          then=peer_checks and peer_checks.before_save(state.global_step)))
    else:
      guard.check()
      checkpointer.save("latest")
    saved_at[0] = state.global_step

  # As in jaxline: no periodic saves at interval 0; growth ratios add saves in steps.
  publishes = peer_positions is not None and bool(peer_positions.names)
  if (save_checkpoints or publishes) and config.save_checkpoint_interval > 0:
    checkpoint_type = interval_type(config, "checkpoint_interval_type")
    actions["checkpoint"] = _SaveAction(
        save_latest, checkpoint_type, config.save_checkpoint_interval, run_async=False,
        logging_growth_ratios=(config.periodic_action_growth_ratios
                               if checkpoint_type == "steps" else None),
        start_time=saved_at_time, start_step=saved_at_step)
  return actions, save_latest


def flush_metrics(write: periodic.PeriodicAction | None, writer: writers.RunWriter,
                   log_all_train_data: bool) -> None:
  """Puts every metric row up to the current step on disk, before a durable save:
  a resumed run never redoes the steps a checkpoint covers."""
  if write is not None:
    if log_all_train_data:
      write.finish()  # Every step's row is kept: those since the last write are held back.
    else:
      write.wait_to_finish()
  writer.flush()
