"""The evaluation loop: each new checkpoint of a series evaluated once, and the best kept.

`evaluate` follows the `latest` series (of a training run in another
process, or of the trainer thread of `train_eval_multithreaded`), restores
each new checkpoint, calls the experiment's `evaluate`, writes its scalars
and, with `best_model_eval_metric`, saves the `best` series when the metric
strictly improves. In a multi-process eval job the chief chooses what every
process evaluates, through the distributed runtime's key-value store.
"""

import itertools
import json
import os
import time
from typing import Any

import jax
from absl import logging

from jaxline_ng import (
  agreement,
  base_config,
  checkpointing,
  debugging,
  devices,
  multihost,
  preemption,
  rng,
  run_lock,
  writers,
  xla_cpu,
)
from jaxline_ng import best as best_lib
from jaxline_ng import experiment as experiment_lib
from jaxline_ng import mesh as mesh_lib
from jaxline_ng import scalars as scalars_lib

# How often a separate eval job looks for a new checkpoint (jaxline's value).
EVAL_POLL_SECS = 10.0


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
  checkpointer = checkpointing.adapt(checkpointer)
  if (multihost.is_multiprocess() and checkpointer.every_process_saves
      and not checkpointer.restores_by_path):
    # The processes read each checkpoint together: each choosing its own, they would wait.
    raise base_config.ConfigError(
        f"{checkpointer.class_name} overrides restore but does not declare restores_by_path: "
        "the processes of this run restore each checkpoint together, the one the chief "
        "chooses (restore(series, path=...)); declare restores_by_path = True in the class")
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
  run_writer = writers.adapt(writer)  # None where this process writes nothing.
  state = checkpointer.get_experiment_state("latest")
  state.global_step = 0
  state.experiment_module = experiment
  if not checkpointer.restores_saved_entries:
    # As jaxline: a checkpointer written for it restores the entries the
    # state holds, and the best state takes the key chain from there.
    state.train_step_rng = None
  best = None
  if config.best_model_eval_metric and (multihost.is_chief() or checkpointing.every_host_saves(
      checkpointer, "best_checkpoint_all_hosts", config)):
    best = best_lib.BestTracker(config, checkpointer, experiment)
  eval_rng = rng.eval_keys(config.random_seed, config.random_mode_eval)
  evaluate_fn = experiment_lib.evaluate_should_return_dict(
      experiment_lib.keyword_filtered(experiment.evaluate))

  # Processes restoring from shared storage (jaxline_ng's disk checkpoints)
  # take the checkpoints the chief chooses; others each evaluate their own.
  follow_chief = multihost.is_multiprocess() and checkpointer.restores_by_path
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
      unloadable = [] if superseded else list(checkpointer.unloadable_newer)
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
    if evaluated_step < 0 and run_writer is not None:
      # This job's first evaluation: a row of its step is an earlier job's
      # (an evaluator restarted over the newest checkpoint), about to be
      # redone. Rows past it are an earlier run's (a run restarted afresh,
      # or a one-off evaluation of an older checkpoint): kept aside.
      run_writer.resume(state.global_step - 1, set_aside_past=state.global_step)
    if evaluated_step < 0 and best is not None:
      best.start_at(state.global_step)
    evaluated_step = state.global_step

    # --- Evaluate, write, track the best. ---
    # As jaxline: per-device on the devices (`step` gets a host array, as there).
    global_step_devices = mesh_lib.placement().step_counter(state.global_step, on_devices=True)
    with experiment_lib.log_activity(f"evaluation at step {state.global_step}"):
      scalars = evaluate_fn(global_step=global_step_devices, rng=eval_rng, writer=writer)
    # The row's loggable values are written before a bad one stops the run:
    # an evaluation can take hours.
    problems = scalars_lib.scalar_problems(scalars, "evaluate()")
    values = scalars_lib.numbers(devices.first_copy_to_host(
        {name: value for name, value in scalars.items() if name not in problems}))
    logging.info("[jaxline_ng] eval step %d: %s", state.global_step, values)
    if writer is not None:
      writer.write_scalars(state.global_step, values)
    if problems:
      if run_writer is not None:
        run_writer.flush()
      raise scalars_lib.ScalarsError(next(iter(problems.values())))
    best_lib.check_best_metric(config, scalars)
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
  if run_writer is not None:
    run_writer.flush()
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
  order: the chief chooses and publishes its choice; the others wait for it,
  passing on any stop request they get meanwhile, or end with a failure a
  process published.
  """
  name = f"eval_decision/{decision}"
  if multihost.is_chief():
    choice = choose()
    agreement.exchange(name, json.dumps(choice), read_from=())
    return choice

  def pass_on_stop_request() -> bool:
    _stop_evaluating()  # Tells the chief, whose next choice is then "stop".
    return False

  chosen = agreement.exchange(name, None, read_from=[0], give_up=pass_on_stop_request)
  if chosen is None:
    agreement.exit_for_peer(agreement.published_failure())
  action, path = json.loads(chosen[0])
  return action, path


def _restored_by_all(decision: int, step: int | None) -> bool:
  """Whether every process of a multi-process evaluation restored the
  `decision`-th checkpoint the chief chose, at `step` here (None: this one
  lost a race with the trainer's rotation of checkpoints). If one did not,
  all go on to the next choice rather than evaluate (and meet in collectives)
  apart."""
  steps = agreement.exchange(f"eval_restored/{decision}", json.dumps(step))
  return step is not None and steps is not None and len(set(steps)) == 1


# Written by the first process of a multi-process evaluation asked to stop.
_EVAL_STOP_KEY = "eval_stop"  # An `agreement.run_key`.


def _stop_evaluating() -> bool:
  """Whether a stop was requested here or, with several processes, in any of them.

  The first process of a multi-process evaluation asked to stop writes it
  in the distributed runtime's key-value store, where the chief looks (one
  store read) whenever it chooses what to evaluate next (`_agreed`).
  """
  if not multihost.is_multiprocess():
    return preemption.stop_requested()
  if preemption.stop_requested():
    agreement.key_value_set(agreement.run_key(_EVAL_STOP_KEY), str(jax.process_index()),
                            allow_existing=True)
    return True
  return agreement.key_value_try_get(agreement.run_key(_EVAL_STOP_KEY)) is not None
