"""The training and evaluation loops.

`train` sets up state and periodic actions around the experiment's
`train_loop`; `evaluate` follows a checkpoint series and evaluates each new
checkpoint once; `train_eval_multithreaded` runs both in one process.
"""

import functools
import inspect
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from jaxline_ng import (
  base_config,
  checkpointing,
  debugging,
  devices,
  guards,
  iterator_state,
  multihost,
  periodic,
  preemption,
  profiling,
  rng,
  run_lock,
  run_record,
  watchdog,
  xla_cpu,
)
from jaxline_ng import experiment as experiment_lib
from jaxline_ng import mesh as mesh_lib

# How often a separate eval job looks for a new checkpoint (jaxline's value).
EVAL_POLL_SECS = 10.0
# In train_eval_multithreaded the evaluator shares the process with training
# and looks more often: checking for a new in-memory checkpoint is free.
MULTITHREADED_EVAL_POLL_SECS = 0.2


class ScalarsError(ValueError):
  """What `step` or `evaluate` returned cannot be logged; the message names the key."""
  one_line = True  # Reported as one line naming the culprit, not a traceback.


class StepExitError(RuntimeError):
  """`sys.exit()` was called inside the training loop (by `step` or a library it
  calls): a failure, not a finished run, which exit code 0 would report."""
  one_line = True


# Array kinds that are not real numbers, which TensorBoard and JSON take:
# complex, bytes, str, object.
_UNLOGGABLE_KINDS = "cSUO"


@functools.cache
def _per_device_lengths() -> tuple[int, ...]:
  """Lengths of one value per device: per local device from pmap, per device of a mesh."""
  return (jax.local_device_count(), jax.device_count())


def _scalar_problem(name: Any, value: Any) -> str | None:
  """Why `value` is not a loggable scalar named `name`, or None if it is.

  A scalar is a number, or one per device: a pmap output the experiment did
  not reduce with `get_first`, or one value copied per device (`global_step`,
  a schedule of it), named by a string. A vector whose length merely equals
  the device count (per-class values) is none. Reads (and waits for) only
  vectors of that length not laid out one per device.
  """
  if not isinstance(name, str):
    return f"has a name of type {type(name).__name__}, not a string"
  if isinstance(value, (int, float)):
    return None
  if isinstance(value, (str, bytes)):
    return f"is a {type(value).__name__} ({value!r:.40})"
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is None or dtype is None:
    return f"is a {type(value).__name__}"
  if getattr(dtype, "kind", "") in _UNLOGGABLE_KINDS:
    return f"has dtype {dtype}"
  if not shape or shape == (1,):
    return None
  if len(shape) == 1 and shape[0] in _per_device_lengths():
    if devices.one_row_per_device(value):
      return None
    # One value copied per device (`global_step` on the host, a schedule of
    # it): the first is all of them. Other values are a vector's (per-class
    # values), whose first would be logged as if it were the whole.
    if devices.equal_rows(value):
      return None
    return (f"is a vector of {shape[0]} differing values, not one per device (its first alone "
            "would be logged)")
  return f"has shape {tuple(shape)}"


def scalar_problems(scalars: Any, producer: str) -> dict[Any, str]:
  """`{name: one line saying why it cannot be logged}` for each bad value of `scalars`.

  Raises ScalarsError if `scalars` is not a mapping at all.
  """
  if not isinstance(scalars, Mapping):
    raise ScalarsError(f"{producer} returned {type(scalars).__name__} {scalars!r:.60}: return a "
                       "dict of scalars {name: value} (an empty dict to log nothing)")
  problems = {}
  for name, value in scalars.items():
    problem = _scalar_problem(name, value)
    if problem is not None:
      problems[name] = (f"{producer} returned scalar {name!r} that {problem}: return numbers, "
                        "or one per local device")
  return problems


def _check_scalars(steps: Sequence[Mapping[str, Any]], producer: str) -> None:
  """Raises ScalarsError naming the first value of `steps` that cannot be logged."""
  for scalars in steps:
    for problem in scalar_problems(scalars, producer).values():
      raise ScalarsError(problem)


def host_scalars_of_steps(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Training steps' outputs as host numbers for logging.

  A value may be a scalar or one copy per local device (a pmap output the
  experiment did not reduce with `get_first`); the first device's copy is
  taken then. Anything else is a ScalarsError naming the scalar.
  """
  _check_scalars(steps, "step()")
  return [_numbers(devices.first_copy_to_host(dict(scalars))) for scalars in steps]


def _numbers(values: dict[str, Any]) -> dict[str, Any]:
  """Host values as Python numbers; one per device (shape [1]) gives its number."""
  for name, value in values.items():
    if not isinstance(value, (int, float)):
      array = np.asarray(value)
      values[name] = (array[0] if array.ndim == 1 else array).item()
  return values


class _DifferingCopies:
  """Warns, once per entry, of CHECKPOINT_ATTRS whose copies differ between
  devices, looked for after the first step and at the first save: state that
  devices bring together only every few steps (K-FAC's curvature estimates)
  can still agree after the first step."""

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


class _FirstStepChecks(periodic.EveryStepAction):
  """A periodic action: stops the run after its first step if what `step`
  returned cannot be logged, or if the experiment's CHECKPOINT_ATTRS cannot
  be saved (`__init__` may leave them to the first step to build), rather
  than at the first write or save, minutes or a whole run later; warns of
  CHECKPOINT_ATTRS whose copies differ between devices.

  Runs on the loop's thread, first of all actions, while the outputs are
  what `step` returned. Later steps' outputs are checked where they are
  read, by logging (`host_scalars_of_steps`); the loop pays for no check.
  """

  def __init__(self, experiment: Any | None, differing_copies: _DifferingCopies):
    self._experiment = experiment  # None where this process does not save.
    self._differing_copies = differing_copies
    self._done = False

  def __call__(self, t: float, step: int, scalars: Any) -> None:
    del t, step
    if self._done:
      return
    self._done = True
    _check_scalars([scalars], "step()")
    if self._experiment is not None:
      problem = experiment_lib.checkpoint_attrs_problem(self._experiment)
      if problem:
        raise experiment_lib.CheckpointAttrsError(problem)
      self._differing_copies.look("after the first step")


def _interval_type(config, specific_key: str) -> str:
  return config[specific_key] or config.interval_type


def _format_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  minutes, secs = divmod(int(seconds), 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}:{minutes:02d}:{secs:02d}"


def _progress_line(step: int, training_steps: int | None, scalars: Mapping[str, Any],
                   eta: bool = True) -> str:
  """"step 120/1000 (12.0%), 85.1 steps/s, ETA 0:00:10 | loss=0.31", from the
  scalars of `step` (with the `steps_per_sec` a periodic action adds); no
  ETA unless `eta`."""
  scalars = dict(scalars)
  steps_per_sec = scalars.pop("steps_per_sec", None)
  parts = [f"step {step}"]
  if training_steps:
    parts[0] += f"/{training_steps} ({100.0 * step / training_steps:.1f}%)"
  if steps_per_sec:
    parts.append(f"{steps_per_sec:.1f} steps/s")
    if training_steps and eta:
      parts.append(f"ETA {_format_duration((training_steps - step) / steps_per_sec)}")
  compact = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in sorted(scalars.items()))
  return "[jaxline_ng] " + ", ".join(parts) + (f" | {compact}" if compact else "")


class _LoggingAction(periodic.PeriodicAction):
  """Logging and writing: each due step's scalars reach `fn` as host numbers
  (`host_scalars_of_steps`), read from the first device's copy alone."""

  def _act_on(self, due):
    try:
      super()._act_on(due)
    except ScalarsError:
      # Raised before acting on any: the steps due before the bad one are
      # valid rows, written before the run stops on it.
      for position, (_, _, scalars) in enumerate(due):
        if not isinstance(scalars, Mapping) or scalar_problems(scalars, "step()"):
          super()._act_on(due[:position])
          break
      raise

  def _to_host(self, scalars):
    return host_scalars_of_steps(scalars)


class _SaveAction(periodic.PeriodicAction):
  """Periodic saving: it reads no scalars (the save's non-finite check reads
  the newest step's), and leaves the last step to the final save (`train`)."""

  def _act_on(self, due):
    for step, _, _ in due:
      self._fn(step, None)

  def finish(self) -> None:
    self.wait_to_finish()


def _default_periodic_actions(config, checkpointer, writer, state, save_checkpoints: bool,
                              guard: guards.NonFiniteGuard,
                              differing_copies: _DifferingCopies,
                              peer_checks: guards.PeerChecks | None = None,
                              peer_positions: iterator_state.PeerPositions | None = None):
  """The non-finite guard, logging to absl, writing scalars, periodic checkpointing.

  The guard sees what logging and writing copy to the host, and each save
  is validated against the newest step before it, so a non-finite state is
  never saved.

  Periodic saving continues from the `(time, step)` it last saved at in the
  restored run (`state.periodic_action_times`, stored with every
  checkpoint), so a resumed run does not restart its saving clock.
  """
  start_step = state.global_step
  keeps_our_entries = _keeps_our_entries(checkpointer, state)
  times = getattr(state, "periodic_action_times", None) if keeps_our_entries else None
  saved_at_time, saved_at_step = (times or {}).get("checkpoint", (time.time(), start_step))
  logging_type = _interval_type(config, "logging_interval_type")
  growth = config.periodic_action_growth_ratios if logging_type == "steps" else None
  actions = {"non_finite_guard": guard}

  # The total and ETA only where `training_steps` ends the run: code written
  # for jaxline often leaves it at its default and ends in `should_run_step`.
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

  # With a `secs` interval the first step is logged and written at once. The
  # first rate is measured from here, as jaxline's from the loop's start (so
  # it includes compilation); a resumed run's from its own start.
  actions["log"] = _LoggingAction(
      log_progress, logging_type, config.log_tensors_interval, start_time=None,
      start_step=start_step, logging_growth_ratios=growth)

  # As in jaxline, a writer given to `train` gets the chief's scalars alone
  # unless `log_all_hosts` (the platform gives other processes none).
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
  # jaxline_ng's checkpointers run the guard after dispatching their copies
  # (the disk one on its save worker); a user's checkpointer gets a checked state.
  validates = "validate" in inspect.signature(checkpointer.save).parameters
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
    if "checkpoint" in actions and keeps_our_entries:
      state.periodic_action_times = {"checkpoint": actions["checkpoint"].last_acted}
    if durable:
      _flush_metrics(actions.get("write"), writer, config.log_all_train_data)
    if state.global_step > start_step:  # Not an initial save, before any step.
      differing_copies.look_at_the_first_save(state.global_step)
    if validates:
      checkpointer.save("latest", validate=guard.seal(
          then=peer_checks and peer_checks.before_save(state.global_step)))
    else:
      guard.check()
      checkpointer.save("latest")
    saved_at[0] = state.global_step

  # As in jaxline: no periodic saves with an interval of 0, and growth ratios
  # add saves too where the interval counts steps.
  publishes = peer_positions is not None and bool(peer_positions.names)
  if (save_checkpoints or publishes) and config.save_checkpoint_interval > 0:
    checkpoint_type = _interval_type(config, "checkpoint_interval_type")
    actions["checkpoint"] = _SaveAction(
        save_latest, checkpoint_type, config.save_checkpoint_interval, run_async=False,
        logging_growth_ratios=(config.periodic_action_growth_ratios
                               if checkpoint_type == "steps" else None),
        start_time=saved_at_time, start_step=saved_at_step)
  return actions, save_latest


def _flush_metrics(write: periodic.PeriodicAction | None, writer,
                   log_all_train_data: bool) -> None:
  """Puts every metric row up to the current step on disk.

  A resumed run never redoes the steps a checkpoint covers, so their rows
  must be on disk before it can be: this runs before a durable `save`, and
  the checkpoint is committed after that, on the save worker. The wait is
  for the write action's due steps (the devices finishing the current
  step) and the writer's flush; `python -m benchmarks.metrics_before_save`
  measures it.
  """
  if write is not None:
    if log_all_train_data:
      write.finish()  # Every step's row is kept: those since the last write are held back.
    else:
      write.wait_to_finish()
  flush_if_possible(writer)


@debugging.disable_pmap_jit  # As jaxline's: for callers other than platform.main.
def train(experiment_class, config, checkpointer, writer,
          periodic_actions: Sequence[periodic.PeriodicAction] = ()) -> None:
  """Trains `experiment_class` until its `should_run_step` says stop.

  Resumes from the checkpointer's `latest` series when it has a checkpoint.
  The chief process (or every process, with `train_checkpoint_all_hosts`)
  checkpoints periodically and at the end. When a stop is requested
  (`preemption`), the loop ends after the current step, the state is saved
  and flushed as at a normal end, and `preemption.Preempted` is raised.
  """
  base_config.add_keys_beyond_jaxline(config)
  save_checkpoints = (multihost.is_chief() or config.train_checkpoint_all_hosts
                      or _every_process_saves(checkpointer))
  _check_saves_agree(config, checkpointer)
  mesh_lib.activate(config)
  multihost.own_collectives()

  # --- State: construct the experiment, then restore over it. ---
  xla_cpu.check_pool()
  train_key, init_key = rng.seed_keys(config.random_seed, config.legacy_random_seed_behavior)
  with experiment_lib.log_activity("experiment init"):
    experiment = experiment_lib.construct(experiment_class, "train", init_key,
                                          config.experiment_kwargs)
  state = checkpointer.get_experiment_state("latest")
  state.global_step = 0
  state.experiment_module = experiment
  state.train_step_rng = experiment.initialize_train_step_rng(train_key)
  run_config = json.dumps(run_record.flat_config(config), sort_keys=True)
  keeps_our_entries = _keeps_our_entries(checkpointer, state)
  resumed = checkpointer.can_be_restored("latest")
  if resumed:
    with experiment_lib.log_activity("checkpoint restore"):
      checkpointer.restore("latest")
    if keeps_our_entries:
      _check_resumed_config(getattr(state, "run_config", None), run_config,
                            config.strict_resume_config)
    started_from = (getattr(checkpointer, "started_from", None)
                    if _is_ours(checkpointer, "restore") else None)
    if started_from and not experiment.should_run_step(state.global_step, config):
      raise base_config.ConfigError(
          f"config.restore_path: the run starts from {started_from} at step "
          f"{state.global_step}, where its training ends (training_steps="
          f"{config.training_steps}); steps count on from the checkpoint's, so set "
          f"training_steps above {state.global_step}")
    if not experiment.should_run_step(state.global_step, config):
      # A rerun of a finished run, or one given fewer training_steps: it would
      # end at once, looking like a run that trained.
      logging.warning("[jaxline_ng] Restored step %d, where this run's training ends "
                      "(training_steps=%s): no step to train.", state.global_step,
                      config.training_steps)
  # After the restore, which builds the entries a fresh experiment leaves to `step`.
  logging.info("[jaxline_ng] Checkpointed state: %s",
               experiment_lib.describe_state(state.experiment_module))
  # Processes that see different checkpoints (a checkpoint_dir not shared)
  # would train together from different steps, and wait on each other's saves.
  multihost.check_same_as_chief(
      "resumed", lambda: {"from step": int(state.global_step)},
      "every process must see the same checkpoints: give them one shared checkpoint_dir")
  if keeps_our_entries:
    state.run_config = run_config
  if writer is not None and hasattr(writer, "resume"):
    # Rows an interrupted run wrote past its last checkpoint are redone from
    # here: the old ones go, in metrics.jsonl and TensorBoard alike (an
    # earlier run's, when there is no checkpoint, are set aside).
    writer.resume(state.global_step)

  # --- Periodic actions: user's, then safety, logging, checkpointing, stops. ---
  guard = guards.NonFiniteGuard(config.non_finite_policy, start_step=state.global_step)
  # With several processes the chief's saves wait for the others' guards,
  # unless every process saves: its own tree (`train_checkpoint_all_hosts`),
  # or its shards of global arrays, whose scalars every process sees alike.
  peer_checks = None
  if (multihost.is_multiprocess() and not config.train_checkpoint_all_hosts
      and not _every_process_saves(checkpointer)):
    peer_checks = guards.PeerChecks(guard)
    if not save_checkpoints:
      peer_checks.answer()
  differing_copies = _DifferingCopies(state.experiment_module if save_checkpoints else None)
  peer_positions = None
  if multihost.is_multiprocess() and not checkpointing.in_memory_only(checkpointer):
    peer_positions = iterator_state.PeerPositions(config, state.experiment_module)
  # Every process runs the saves where each hands its data positions to the chief's.
  saves = save_checkpoints or bool(peer_positions and peer_positions.names)
  default_actions, save_latest = _default_periodic_actions(
      config, checkpointer, writer, state, save_checkpoints, guard, differing_copies,
      peer_checks, peer_positions)
  for action in periodic_actions:  # As jaxline: the caller's actions count from now.
    if hasattr(action, "update_time"):
      action.update_time(time.time(), state.global_step)
  # Made last: its clock for the first step starts as the loop does.
  stuck_steps = watchdog.StepWatchdog(config.step_timeout_secs, start_step=state.global_step)
  own_actions = [*default_actions.values(),
                 preemption.StopCheck(config.wall_clock_budget_secs, start_step=state.global_step),
                 stuck_steps]
  if config.profile_steps:
    own_actions.append(profiling.ProfileWindow(
        *config.profile_steps, logdir=os.path.join(config.checkpoint_dir, "train", "profile"),
        steps_completed=state.global_step))
  # A tuple, as jaxline's: published train_loop overrides add theirs with `+ (action,)`.
  actions = (_FirstStepChecks(state.experiment_module if save_checkpoints else None,
                              differing_copies),
             *periodic_actions, *own_actions)
  if config.save_initial_train_checkpoint and saves and not resumed:
    save_latest()

  # --- The loop, then the final step's logging and save. ---
  preempted = None
  try:
    try:
      state.experiment_module.train_loop(config, state, actions, writer)
    except preemption.Preempted as e:
      logging.warning("[jaxline_ng] %s: saving and exiting.", e)
      if threading.current_thread() is threading.main_thread():
        # Served, so a later run in this program starts afresh. The trainer
        # of `train_eval_multithreaded` leaves it to the evaluator (the main
        # thread), which must see it too.
        preemption.consume_stop_request()
      preempted = e
    except SystemExit as e:
      # Saves made before it stand; nothing after them is saved.
      raise StepExitError(
          f"step raised SystemExit({e.code!r}) at step {state.global_step} (sys.exit() in "
          "the experiment or a library it calls): the run failed; its last saved checkpoint "
          "is kept") from None
    for action in periodic_actions:
      action.wait_to_finish()
    for action in own_actions:  # Logs and writes the last step even if it was not due.
      action.finish()
    if saves:
      with experiment_lib.log_activity("final checkpoint"):
        save_latest()
  except BaseException as error:
    stuck_steps.close()
    # The rows of the steps run are written before the writer closes (one
    # closed under a queued write would raise a second, misleading error), and
    # saves made before the error still land (the guard vetoes any it covers).
    if peer_checks is not None and not save_checkpoints and isinstance(error, Exception):
      peer_checks.answer_before_failing()
    for action in own_actions:
      try:
        action.wait_to_finish()
      except Exception:  # pylint: disable=broad-except  (raised or reported already)
        pass
    try:
      checkpointer.wait_for_checkpointing_to_finish()
    except Exception as pending:  # pylint: disable=broad-except  (the loop's error matters more)
      if pending is not error:  # A failed save is raised again by every later wait.
        logging.exception("[jaxline_ng] A pending save failed too:")
    raise

  # --- Wrap-up: wait for async work. ---
  try:
    checkpointer.wait_for_checkpointing_to_finish()
    flush_if_possible(writer)
    # The other processes answer the chief's checks until it has saved.
    multihost.rendezvous("jaxline_ng_train_end")
  finally:
    stuck_steps.close()
  if peer_checks is not None:
    peer_checks.close()
  if preempted is not None:
    if checkpointing.in_memory_only(checkpointer):
      logging.warning("[jaxline_ng] The checkpoints are in memory: a rerun starts afresh, so "
                      "the exit code is %d, not %d (--config.checkpointer=disk keeps them and "
                      "exits %d).", preemption.EXIT_STOPPED_UNSAVED, preemption.EXIT_PREEMPTED,
                      preemption.EXIT_PREEMPTED)
    raise preempted


def _keeps_our_entries(checkpointer, state) -> bool:
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
  return (isinstance(state, checkpointing.ExperimentState) and _is_ours(checkpointer, "restore")
          and _is_ours(checkpointer, "save"))


def _every_process_saves(checkpointer) -> bool:
  """Whether every process takes part in each save (a disk checkpoint of arrays
  sharded over several processes: each writes its own shards)."""
  return getattr(checkpointer, "every_process_saves", False) is True  # Not a Mock's attribute.


def _check_saves_agree(config, checkpointer) -> None:
  """Refuses periodic saves by seconds where every process saves.

  Each process would read its own clock and so save after another step.
  Where every process writes its shards of one save, the processes would
  abort at the first periodic save; where each saves its own with a
  checkpointer that is not jaxline_ng's (`train_checkpoint_all_hosts`), each
  would resume from another step. jaxline refused seconds for saves on every
  host (`base_config.check_constraints`); jaxline_ng's own checkpointers
  resume every process from the chief's saves.
  """
  checkpoint_type = _interval_type(config, "checkpoint_interval_type")
  if checkpoint_type == "steps" or config.save_checkpoint_interval <= 0:
    return
  if _every_process_saves(checkpointer):
    why = ("every process of this multi-process mesh run writes its shards of each save, so "
           "all must save after the same step")
  elif (multihost.is_multiprocess() and config.train_checkpoint_all_hosts
        and not _is_ours(checkpointer, "restore")):
    why = (f"with config.train_checkpoint_all_hosts=True each process saves its own, and "
           f"{type(checkpointer).__name__} would resume each from another step")
  else:
    return
  culprit = "checkpoint_interval_type" if config.checkpoint_interval_type else "interval_type"
  raise base_config.ConfigError(
      f"config.{culprit}={checkpoint_type!r} times saves by each process's own clock, but "
      f"{why}: set config.checkpoint_interval_type='steps' and config.save_checkpoint_interval "
      "to a number of steps")


def _check_resumed_config(saved: str | None, current: str, strict: bool) -> None:
  """Logs (or, if `strict`, refuses) config keys that differ from the checkpoint's."""
  if saved is None:
    return
  changed = run_record.differences(json.loads(saved), json.loads(current))
  if not changed:
    return
  if strict:
    raise base_config.ConfigError(
        "config.strict_resume_config: the checkpoint was made with a different config: "
        + "; ".join(changed))
  logging.warning("[jaxline_ng] Resuming with a config that differs from the checkpoint's:\n  %s",
                  "\n  ".join(changed))


_OUR_CHECKPOINTERS = ("jaxline_ng.checkpointing", "jaxline_ng.disk_checkpointing")


def _is_ours(checkpointer, method: str) -> bool:
  """Whether `checkpointer`'s `method` is jaxline_ng's (not a user's override)."""
  # Looked up on the class: a `mock.Mock()` or a wrapper forwarding through
  # `__getattr__` has the method on the instance alone.
  return getattr(getattr(type(checkpointer), method, None), "__module__",
                 None) in _OUR_CHECKPOINTERS


class _BestTracker:
  """Saves the `best` series when the eval metric strictly improves."""

  def __init__(self, config, checkpointer, experiment):
    self._metric = config.best_model_eval_metric
    self._higher_is_better = config.best_model_eval_metric_higher_is_better
    self._checkpointer = checkpointer
    self._state = checkpointer.get_experiment_state("best")
    # As jaxline, the state holds every entry before `best` is restored into
    # it: a checkpointer written for jaxline restores the entries it finds,
    # the experiment's through its `restore_from_snapshot`. jaxline_ng's own
    # checkpointers skip the weights of a state holding no experiment.
    self._worst = -math.inf if self._higher_is_better else math.inf
    self._state.best_eval_metric_value = self._worst
    self._state.best_model_eval_metric = self._metric
    self._state.experiment_module = None if _is_ours(checkpointer, "restore") else experiment
    self._restored_step = None
    if checkpointer.can_be_restored("best"):
      checkpointer.restore("best")
      self._restored_step = getattr(self._state, "global_step", None)
    if getattr(self._state, "best_eval_metric_value", None) is None:
      self._state.best_eval_metric_value = self._worst
    saved_metric = self._state.best_model_eval_metric
    if saved_metric != self._metric:
      # Its best value is another metric's: compared with this one's, better
      # checkpoints would go unsaved or worse ones be saved.
      raise base_config.ConfigError(
          f"config.best_model_eval_metric={self._metric!r}, but the best checkpoints "
          f"(restore path {checkpointer.restore_path('best')}) are the best {saved_metric!r}: "
          "move them aside, or evaluate in another checkpoint_dir or --jaxline_mode=eval_<name>")
    self._state.experiment_module = experiment
    logging.info("[jaxline_ng] Best %s so far: %s", self._metric,
                 self._state.best_eval_metric_value)

  def start_at(self, step: int) -> None:
    """Before the first evaluation, of `step`: a best saved past it is an
    earlier run's (a run restarted afresh), which this run's must not have to
    beat, nor mix with in one series. Set aside, as its metric rows are,
    where the checkpointer can (`set_aside`); else kept, to be beaten."""
    if self._restored_step is None or self._restored_step <= step:
      return
    set_aside = getattr(self._checkpointer, "set_aside", None)
    past = (f"The best checkpoint ({self._metric}={self._state.best_eval_metric_value} at step "
            f"{self._restored_step}) is past step {step}, evaluated first")
    self._restored_step = None
    # A checkpointer of the user's may hold one best only: starting afresh
    # would overwrite a better one.
    if set_aside is None:
      logging.warning("[jaxline_ng] %s: kept, so this run's best must beat it.", past)
      return
    logging.warning("[jaxline_ng] %s: an earlier run's, set aside. This run's best starts "
                    "afresh.", past)
    set_aside("best")
    self._state.best_eval_metric_value = self._worst

  def update(self, evaluated, scalars: Mapping[str, Any]) -> None:
    """Saves `best` if `scalars` beat it; `evaluated` is the `latest` state evaluated."""
    global_step = evaluated.global_step
    value = float(scalars[self._metric])
    if not math.isfinite(value):
      logging.warning("[jaxline_ng] %s=%s at step %d is not finite: never the best.",
                      self._metric, value, global_step)
      return
    best = self._state.best_eval_metric_value
    # Strict comparisons: ties do not save, and NaN never does.
    improved = value > best if self._higher_is_better else value < best
    if not improved:
      return
    logging.info("[jaxline_ng] New best %s=%s at step %d (was %s).",
                 self._metric, value, global_step, best)
    self._state.best_eval_metric_value = value
    self._state.global_step = global_step
    if getattr(evaluated, "train_step_rng", None) is not None:  # As jaxline's best state.
      self._state.train_step_rng = evaluated.train_step_rng
    self._state.experiment_module.on_new_best_model(self._state)
    self._checkpointer.save("best")


def _check_best_metric(config, scalars: Mapping[str, Any]) -> None:
  name = config.best_model_eval_metric
  if name and name not in scalars:
    raise base_config.ConfigError(
        f"config.best_model_eval_metric={name!r} is not among the scalars evaluate returned: "
        f"{sorted(scalars) if scalars else 'none (None or an empty dict)'}")


@debugging.disable_pmap_jit  # As jaxline's: for callers other than platform.main.
def evaluate(experiment_class, config, checkpointer, writer,
             jaxline_mode: str | None = None, *,
             poll_interval_secs: float = EVAL_POLL_SECS,
             stop_waiting=None) -> None:
  """Evaluates each new checkpoint of the `latest` series once.

  Each step is evaluated at most once, in increasing order. A save can land
  between `restore_path` and `restore`, so the checkpoint restored may be newer
  than the one polled; the step restored, not the path, says what was
  evaluated (keyed on the path, such a step would be evaluated twice).

  Stops after evaluating a checkpoint whose step ends training (by the
  experiment's `should_run_step`), after one evaluation with
  `one_off_evaluate`, or when `stop_waiting()` says no new checkpoint will
  come (in `train_eval_multithreaded`, the training thread is gone). A stop
  request (`preemption`) ends it after the evaluation in progress, or at
  once while it waits, by raising `preemption.Preempted`.
  """
  base_config.add_keys_beyond_jaxline(config)
  if jaxline_mode is None:
    from absl import flags  # Only the command-line path reads the flag.
    jaxline_mode = flags.FLAGS.jaxline_mode
  mesh_lib.activate(config)
  if multihost.is_multiprocess():  # train_eval_multithreaded is single-process.
    multihost.own_collectives()

  xla_cpu.check_pool()
  with experiment_lib.log_activity("experiment init"):
    # jaxline initialises the evaluator from the seed's own key.
    experiment = experiment_lib.construct(experiment_class, jaxline_mode,
                                          jax.random.PRNGKey(config.random_seed),
                                          config.experiment_kwargs)
  state = checkpointer.get_experiment_state("latest")
  state.global_step = 0
  state.experiment_module = experiment
  if not _is_ours(checkpointer, "restore"):
    # As jaxline: a checkpointer written for it restores the entries the
    # state holds, and the best state takes the key chain from there.
    state.train_step_rng = None
  best = None
  if config.best_model_eval_metric and (multihost.is_chief() or config.best_checkpoint_all_hosts
                                        or _every_process_saves(checkpointer)):
    best = _BestTracker(config, checkpointer, experiment)
  eval_rng = rng.eval_keys(config.random_seed, config.random_mode_eval)
  evaluate_fn = experiment_lib.evaluate_should_return_dict(
      experiment_lib.keyword_filtered(experiment.evaluate))

  # Processes restoring from shared storage (jaxline_ng's disk checkpoints)
  # take the checkpoints the chief chooses; others each evaluate their own.
  follow_chief = (multihost.is_multiprocess()
                  and "path" in inspect.signature(checkpointer.restore).parameters)
  if config.one_off_evaluate and not config.eval_initial_weights and \
      not checkpointer.can_be_restored("latest"):
    # As jaxline: nothing will come to a one-off evaluation (a mistyped
    # checkpoint_dir, most likely), so it must not wait.
    raise base_config.ConfigError(
        f"config.one_off_evaluate=True but {config.checkpoint_dir} has no checkpoint to "
        "evaluate (set config.eval_initial_weights=True to evaluate the initial weights)")
  restored = _checkpoint_version(None)
  evaluated_step = -1
  initial_weights_pending = config.eval_initial_weights
  asked_to_stop = False
  finished_run_steps = None  # The training_steps of the finished run evaluated last.
  unloadable = []  # Newer checkpoints than the one evaluated last, which did not load.
  polls_without_trainer = 0

  def training_is_over():
    # train_eval_multithreaded's trainer says when it ends. An eval job's
    # `training_steps` may exceed those of the run it follows (set on the
    # trainer's command line): it is done with that run's last checkpoint
    # when no training run holds the directory at several polls in a row
    # (one relaunched to extend the run takes a while to start).
    nonlocal polls_without_trainer
    if stop_waiting is not None:
      return stop_waiting()
    if finished_run_steps is None and not unloadable:
      return False
    trainer = run_lock.holder(config.checkpoint_dir, "train")
    if trainer is not None:
      if polls_without_trainer >= 0 and finished_run_steps is not None:
        logging.info("[jaxline_ng] Step %d ended the training run that saved it, but %s holds "
                     "its train lock: waiting for its checkpoints.", evaluated_step, trainer)
      polls_without_trainer = -1  # Said once.
      return False
    polls_without_trainer = max(polls_without_trainer, 0) + 1
    return polls_without_trainer >= _POLLS_WITHOUT_TRAINER

  for decision in itertools.count():
    # --- Wait for something to evaluate. ---
    def next_checkpoint():
      return _next_checkpoint(checkpointer, restored, initial_weights_pending,
                              training_is_over, poll_interval_secs, config.one_off_evaluate)
    action, path = _agreed(decision, next_checkpoint) if follow_chief else next_checkpoint()
    if action == "stop":
      asked_to_stop = True
      break
    if action == "done":
      if unloadable:
        raise base_config.ConfigError(
            f"checkpoint {unloadable[0]} could not be loaded (step {evaluated_step} was evaluated "
            f"instead) and no training run holds {config.checkpoint_dir} to save past it: resume "
            "the training run, then evaluate again")
      if finished_run_steps is not None:
        logging.warning("[jaxline_ng] Step %d ended the training run that saved it (its "
                        "training_steps=%d, this job's %s): no newer checkpoint will come.",
                        evaluated_step, finished_run_steps, config.training_steps)
      break
    if action == "restore":
      restored = _checkpoint_version(path)  # Before restoring: a save meanwhile is new.
      superseded = False
      with experiment_lib.log_activity("checkpoint restore"):
        try:
          if follow_chief:
            checkpointer.restore("latest", path=path)  # The chief's choice, not a newer one.
          else:
            checkpointer.restore("latest")
        except checkpointing.CheckpointSuperseded as e:
          logging.warning("[jaxline_ng] Not evaluated: %s; going on to the newer one.", e)
          superseded = True
      # Only jaxline_ng's disk checkpointer falls back past what does not load.
      unloadable = (list(getattr(checkpointer, "unloadable_newer", ()))
                    if not superseded and _is_ours(checkpointer, "restore") else [])
      step_here = None if superseded else state.global_step
      if follow_chief and not _restored_by_all(decision, step_here):
        if not superseded:
          logging.warning("[jaxline_ng] Not evaluated: another process could not restore %s; "
                          "going on to the newer one.", path)
        superseded = True
      if superseded or state.global_step <= evaluated_step:
        continue
    else:  # "initial"
      state.global_step = 0
    initial_weights_pending = False
    if evaluated_step < 0 and writer is not None and hasattr(writer, "resume"):
      # This job's first evaluation: a row of its step is an earlier job's
      # (an evaluator restarted over the newest checkpoint), about to be
      # redone. Rows past it are an earlier run's (a run restarted afresh,
      # or a one-off evaluation of an older checkpoint): kept aside.
      writer.resume(state.global_step - 1, set_aside_past=state.global_step)
    if evaluated_step < 0 and best is not None:
      best.start_at(state.global_step)
    evaluated_step = state.global_step

    # --- Evaluate, write, track the best. ---
    # As jaxline: per-device on the devices (`step` gets a host array, as there).
    global_step_devices = (
        rng.step_counter(state.global_step) if mesh_lib.active_mesh() is not None
        else devices.bcast_local_devices(np.int32(state.global_step)))
    with experiment_lib.log_activity(f"evaluation at step {state.global_step}"):
      scalars = evaluate_fn(global_step=global_step_devices, rng=eval_rng, writer=writer)
    # The row's loggable values are written before a bad one stops the run:
    # an evaluation can take hours.
    problems = scalar_problems(scalars, "evaluate()")
    values = _numbers(devices.first_copy_to_host(
        {name: value for name, value in scalars.items() if name not in problems}))
    logging.info("[jaxline_ng] eval step %d: %s", state.global_step, values)
    if writer is not None:
      writer.write_scalars(state.global_step, values)
    if problems:
      flush_if_possible(writer)
      raise ScalarsError(next(iter(problems.values())))
    _check_best_metric(config, scalars)
    if best is not None:
      best.update(state, values)

    # --- Done? ---
    if config.one_off_evaluate:
      break
    if not experiment.should_run_step(state.global_step, config):
      if (trains_on := _saved_training_steps(state)) is not None and experiment.should_run_step(
          state.global_step, _with_training_steps(config, trains_on)):
        # As jaxline, this job's config says when to stop, but the run goes on.
        logging.warning("[jaxline_ng] Step %d ends this job's training_steps=%s; the run that "
                        "saved it trains to %d (give the eval job --config.training_steps=%d to "
                        "follow it).", state.global_step, config.training_steps, trains_on,
                        trains_on)
      break
    finished_run_steps = None if stop_waiting else _finished_run_steps(experiment, config, state)
    polls_without_trainer = 0
  checkpointer.wait_for_checkpointing_to_finish()
  flush_if_possible(writer)
  if asked_to_stop:
    logging.warning("[jaxline_ng] Evaluation stopped by %s %s.", preemption.stop_reason(),
                    f"after step {evaluated_step}" if evaluated_step >= 0
                    else "before evaluating any step")
    raise preemption.Preempted(f"evaluation stopped by {preemption.stop_reason()}")


# How many polls in a row must find no training run holding the directory
# before an eval job is done with the finished run it followed.
_POLLS_WITHOUT_TRAINER = 3


def _finished_run_steps(experiment, config, state) -> int | None:
  """The `training_steps` of the run that saved the restored checkpoint, if
  they differ from this job's and the run ended at it (by the experiment's
  `should_run_step`)."""
  saved = _saved_training_steps(state)
  if saved is None or saved == config.training_steps:
    return None
  return None if experiment.should_run_step(state.global_step,
                                            _with_training_steps(config, saved)) else saved


def _saved_training_steps(state) -> int | None:
  """The `training_steps` in the config jaxline_ng's checkpoints keep, or None."""
  try:
    saved = json.loads(getattr(state, "run_config", None) or "{}").get("training_steps")
  except (TypeError, ValueError):  # Not ours: a checkpointer of the user's.
    return None
  return saved if isinstance(saved, int) else None


def _with_training_steps(config, training_steps: int):
  config = config.copy_and_resolve_references()
  config.training_steps = training_steps
  return config


def flush_if_possible(writer) -> None:
  """Flushes `writer` if it can: jaxline's `Writer` protocol requires only
  `write_scalars` and `write_images`."""
  flush = getattr(writer, "flush", None)
  if flush is not None:
    flush()


def _checkpoint_version(path: Any) -> tuple:
  """What tells the checkpoint `restore_path` names from the next one.

  jaxline_ng's checkpointers name each checkpoint differently. A user's may
  overwrite one file at every save (tapnet's `NumpyFileCheckpointer`), so
  its path stays the same while the file's identity, time and size change.
  """
  if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
    try:
      info = os.stat(path)
    except OSError:  # Replaced just now: the next poll sees the new file.
      return (path,)
    return (path, info.st_ino, info.st_mtime_ns, info.st_size)
  return (path,)


def _next_checkpoint(checkpointer, restored: tuple, initial_weights_pending: bool, stop_waiting,
                     poll_interval_secs: float, one_off: bool = False) -> tuple[str, str | None]:
  """Waits for the evaluator's next action: `(action, checkpoint path or None)`.

  `restored` is the `_checkpoint_version` of the checkpoint evaluated last.
  The action is "stop" (a stop request), "restore" (a new checkpoint),
  "initial" (evaluate the initial weights) or "done" (`stop_waiting()`: no
  new checkpoint will come).
  """
  logged_wait = False
  started = time.monotonic()
  reminders = 0
  while True:
    if _stop_evaluating():
      return "stop", None
    path = checkpointer.restore_path("latest")
    # As jaxline: a one-off evaluation restores whatever can be restored; a
    # continuous one each new checkpoint `restore_path` names, once it can be
    # (a user's checkpointer may name a file before writing it).
    restorable = (one_off or path is not None) and checkpointer.can_be_restored("latest")
    if restorable and (one_off or _checkpoint_version(path) != restored):
      return "restore", path
    if initial_weights_pending and (one_off or path is None):
      return "initial", None
    if stop_waiting is not None and stop_waiting():
      return "done", None
    if not logged_wait:  # Once a wait: a silent evaluator looks hung.
      logging.info("[jaxline_ng] Waiting for a new checkpoint (last evaluated: %s).",
                   restored[0] if restored[0] is not None else "none")
      logged_wait = True
    waited = time.monotonic() - started
    if not restorable and waited >= (reminders + 1) * _NO_CHECKPOINT_REMINDER_SECS:
      # An evaluator started before its trainer is normal; one given a
      # mistyped checkpoint_dir would otherwise wait in silence forever.
      reminders += 1
      logging.warning("[jaxline_ng] Still no checkpoint to restore after %.0f min (restore "
                      "path: %s): is a training run saving to this config.checkpoint_dir?",
                      waited / 60, path)
    _wait_for_stop(poll_interval_secs)


_NO_CHECKPOINT_REMINDER_SECS = 600.0


# How often the chief of a multi-process evaluation, waiting for a checkpoint,
# looks whether another process was asked to stop (one key-value store read).
_PEER_STOP_POLL_SECS = 0.25


def _wait_for_stop(secs: float) -> None:
  """Waits `secs`, or less once a stop is requested here or in another process:
  the others wait for the chief's next choice, which is then "stop"."""
  deadline = time.monotonic() + secs
  slice_secs = _PEER_STOP_POLL_SECS if multihost.is_multiprocess() else secs
  while (left := deadline - time.monotonic()) > 0:
    if preemption.wait_for_stop(min(left, slice_secs)) or _stop_evaluating():
      return


def _agreed(decision: int, choose) -> tuple[str, str | None]:
  """The chief's `choose()` for the `decision`-th wait, on every process.

  The processes of a multi-process evaluation restore together (checking
  arrays sharded over them is a collective) and evaluate together (their
  `evaluate` may be), so they must take the same checkpoints in the same
  order: the chief chooses and publishes its choice through the
  distributed runtime's key-value store; the others wait for it there,
  passing on any stop request they get meanwhile.
  """
  key = multihost.run_key(f"eval_decision/{decision}")
  if multihost.is_chief():
    choice = choose()
    multihost.key_value_set(key, json.dumps(choice))
    return choice

  def pass_on_stop_request() -> bool:
    _stop_evaluating()  # Tells the chief, whose next choice is then "stop".
    return False

  action, path = json.loads(multihost.key_value_wait(key, give_up=pass_on_stop_request))
  return action, path


def _restored_by_all(decision: int, step: int | None) -> bool:
  """Whether every process of a multi-process evaluation restored the
  `decision`-th checkpoint the chief chose, at `step` here (None: this one
  lost a race with the trainer's rotation of checkpoints). If one did not,
  all go on to the next choice rather than evaluate (and meet in collectives)
  apart."""
  steps = multihost.every_process_value(f"eval_restored/{decision}", json.dumps(step))
  return step is not None and steps is not None and len(set(steps)) == 1


# Written by the first process of a multi-process evaluation asked to stop.
_EVAL_STOP_KEY = "eval_stop"  # A `multihost.run_key`.


def _stop_evaluating() -> bool:
  """Whether a stop was requested here or, with several processes, in any of them.

  The first process of a multi-process evaluation asked to stop writes it
  in the distributed runtime's key-value store, where the chief looks (one
  store read) whenever it chooses what to evaluate next (`_agreed`).
  """
  if not multihost.is_multiprocess():
    return preemption.stop_requested()
  if preemption.stop_requested():
    multihost.key_value_set(multihost.run_key(_EVAL_STOP_KEY), str(jax.process_index()),
                            allow_existing=True)
    return True
  return multihost.key_value_try_get(multihost.run_key(_EVAL_STOP_KEY)) is not None


@debugging.disable_pmap_jit  # As jaxline's: for callers other than platform.main.
def train_eval_multithreaded(experiment_class, config, checkpointer, writer,
                             eval_writer=None, eval_checkpointer=None) -> None:
  """Trains on a background thread while the main thread evaluates.

  The evaluator's experiment is constructed with mode
  "train_eval_multithreaded", as in jaxline. If training raises, evaluation
  stops after the evaluation in progress and the training error is raised
  here (jaxline hung forever).
  The evaluator restores through `eval_checkpointer` (default: `checkpointer`),
  which must see the trainer's saves.

  Raises:
    base_config.ConfigError: with several processes. Nothing orders the
      evaluator's thread against training's, so their collectives (a pmean
      of gradients, a psum of metrics) would reach the devices in another
      order in each process, which aborts or hangs the run.
  """
  if multihost.is_multiprocess():
    raise base_config.ConfigError(
        f"--jaxline_mode=train_eval_multithreaded over {jax.process_count()} processes: the "
        "evaluator's collectives would interleave with training's in another order in each "
        "process and abort the run; run --jaxline_mode=eval as a job of its own beside training")
  if (eval_writer is not None and hasattr(eval_writer, "resume")
      and not checkpointer.can_be_restored("latest")):
    # Training starts at step 0 (`train` sets its own writer's earlier rows
    # aside): so do the evaluator's, before it can write.
    eval_writer.resume(0)
  training_errors: list[BaseException] = []

  def run_training():
    try:
      train(experiment_class, config, checkpointer, writer)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised on the main thread)
      training_errors.append(e)
      if not preemption.stop_requested():
        # The evaluator ends after the evaluation in progress, as at a stop
        # request: evaluating the newer checkpoints too would keep a failed
        # run going for hours.
        preemption.request_stop("the training thread's failure")

  trainer = threading.Thread(target=run_training, name="jaxline_ng_train", daemon=True)
  trainer.start()
  # A stop request stops the trainer too, which saves first: it is waited
  # for. If evaluation fails, the trainer is asked to stop and waited for,
  # so its last save lands and the evaluation's error is the one reported.
  try:
    evaluate(experiment_class, config,
             checkpointer if eval_checkpointer is None else eval_checkpointer, eval_writer,
             jaxline_mode="train_eval_multithreaded",
             poll_interval_secs=MULTITHREADED_EVAL_POLL_SECS,
             stop_waiting=lambda: not trainer.is_alive())
  except preemption.Preempted:
    trainer.join()
    preemption.consume_stop_request()
    if training_errors:
      raise training_errors[0] from None
    raise
  except Exception:
    preemption.request_stop("the evaluator's failure")
    trainer.join()
    raise
  trainer.join()
  if training_errors:
    raise training_errors[0]
