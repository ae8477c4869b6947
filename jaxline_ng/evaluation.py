"""The evaluation loop: each new checkpoint of `latest` evaluated once, the best kept.

In a multi-process eval job the chief chooses what every process evaluates.
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

EVAL_POLL_SECS = 10.0  # How often an eval job looks for a new checkpoint (jaxline's value).
# Polls in a row finding no training run holding the directory before the eval job is done.
_POLLS_WITHOUT_TRAINER = 3
_NO_CHECKPOINT_REMINDER_SECS = 600.0
# How often a multi-process evaluation's waiting chief looks for a peer's stop request.
_PEER_STOP_POLL_SECS = 0.25
_EVAL_STOP_KEY = "eval_stop"  # An `agreement.run_key`, written by the first process asked to stop.


@debugging.disable_pmap_jit  # As jaxline's: for callers other than platform.main.
def evaluate(experiment_class, config, checkpointer, writer,
             jaxline_mode: str | None = None, *,
             poll_interval_secs: float = EVAL_POLL_SECS,
             stop_waiting=None) -> None:
  """Evaluates each new checkpoint of the `latest` series once.

  Each step is evaluated at most once, in increasing order: the step
  restored, not the path polled, says what was evaluated (a save can land
  between the two). Stops after a step that ends training, after one
  evaluation with `one_off_evaluate`, or once `stop_waiting()` says no
  checkpoint will come. A stop request ends it after the evaluation in
  progress, or at once while it waits, by raising `preemption.Preempted`.
  """
  base_config.add_keys_beyond_jaxline(config)
  checkpointer = checkpointing.adapt(checkpointer)
  if (multihost.is_multiprocess() and checkpointer.every_process_saves
      and not checkpointer.restores_by_path):  # Each choosing its own, they would wait.
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
  with experiment_lib.log_activity("experiment init"):  # From the seed's key, as jaxline.
    experiment = experiment_lib.construct(experiment_class, jaxline_mode,
                                          jax.random.PRNGKey(config.random_seed),
                                          config.experiment_kwargs)
  run_writer = writers.adapt(writer)  # None where this process writes nothing.
  state = checkpointer.get_experiment_state("latest")
  state.global_step = 0
  state.experiment_module = experiment
  if not checkpointer.restores_saved_entries:  # As jaxline: it restores the entries held.
    state.train_step_rng = None
  best = None
  if config.best_model_eval_metric and (multihost.is_chief() or checkpointing.every_host_saves(
      checkpointer, "best_checkpoint_all_hosts", config)):
    best = best_lib.BestTracker(config, checkpointer, experiment)
  eval_rng = rng.eval_keys(config.random_seed, config.random_mode_eval)
  evaluate_fn = experiment_lib.evaluate_should_return_dict(
      experiment_lib.keyword_filtered(experiment.evaluate))

  follow_chief = multihost.is_multiprocess() and checkpointer.restores_by_path
  if config.one_off_evaluate and not config.eval_initial_weights and \
      not checkpointer.can_be_restored("latest"):  # As jaxline: nothing will come.
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
    # An eval job is done with a finished run once no training run holds the
    # directory at several polls in a row (a relaunch takes a while to start).
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
      # A row of this step is an earlier job's, to be redone; rows past it an earlier run's.
      run_writer.resume(state.global_step - 1, set_aside_past=state.global_step)
    if evaluated_step < 0 and best is not None:
      best.start_at(state.global_step)
    evaluated_step = state.global_step

    # As jaxline: per-device on the devices (`step` gets a host array, as there).
    global_step_devices = mesh_lib.placement().step_counter(state.global_step, on_devices=True)
    with experiment_lib.log_activity(f"evaluation at step {state.global_step}"):
      scalars = evaluate_fn(global_step=global_step_devices, rng=eval_rng, writer=writer)
    # The loggable values are written before a bad one stops the run: it took hours maybe.
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

    if config.one_off_evaluate:
      break
    try:  # The training_steps of the run that saved it, in jaxline_ng's checkpoints.
      trains_on = json.loads(getattr(state, "run_config", None) or "{}").get("training_steps")
    except (TypeError, ValueError):  # A user's checkpointer's.
      trains_on = None
    run_ends = False
    if isinstance(trains_on, int):
      run_config = config.copy_and_resolve_references()
      run_config.training_steps = trains_on
      run_ends = not experiment.should_run_step(state.global_step, run_config)
    if not experiment.should_run_step(state.global_step, config):
      if isinstance(trains_on, int) and not run_ends:  # As jaxline, this job's config decides.
        logging.warning("[jaxline_ng] Step %d ends this job's training_steps=%s; the run that "
                        "saved it trains to %d (give the eval job --config.training_steps=%d to "
                        "follow it).", state.global_step, config.training_steps, trains_on,
                        trains_on)
      break
    finished_run_steps = (trains_on if run_ends and not stop_waiting
                          and trains_on != config.training_steps else None)
    polls_without_trainer = 0
  checkpointer.wait_for_checkpointing_to_finish()
  if run_writer is not None:
    run_writer.flush()
  if asked_to_stop:
    logging.warning("[jaxline_ng] Evaluation stopped by %s %s.", preemption.stop_reason(),
                    f"after step {evaluated_step}" if evaluated_step >= 0
                    else "before evaluating any step")
    raise preemption.Preempted(f"evaluation stopped by {preemption.stop_reason()}")


def _checkpoint_version(path: Any) -> tuple:
  """What tells the checkpoint `restore_path` names from the next one: a user's
  checkpointer may overwrite one file at every save, whose identity then changes."""
  if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
    try:
      info = os.stat(path)
    except OSError:  # Replaced just now: the next poll sees the new file.
      return (path,)
    return (path, info.st_ino, info.st_mtime_ns, info.st_size)
  return (path,)


def _next_checkpoint(checkpointer, restored: tuple, initial_weights_pending: bool, stop_waiting,
                     poll_interval_secs: float, one_off: bool = False) -> tuple[str, str | None]:
  """Waits for the evaluator's next action: `(action, checkpoint path or None)`,
  the action "stop", "restore", "initial" (weights) or "done" (`stop_waiting()`)."""
  logged_wait = False
  started = time.monotonic()
  reminders = 0
  while True:
    if _stop_evaluating():
      return "stop", None
    path = checkpointer.restore_path("latest")
    # As jaxline: a one-off evaluation restores whatever can be; a continuous one each
    # new checkpoint `restore_path` names, once it can be.
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
      reminders += 1
      logging.warning("[jaxline_ng] Still no checkpoint to restore after %.0f min (restore "
                      "path: %s): is a training run saving to this config.checkpoint_dir?",
                      waited / 60, path)
    _wait_for_stop(poll_interval_secs)


def _wait_for_stop(secs: float) -> None:
  """Waits `secs`, or less once a stop is requested here or in another process:
  the others wait for the chief's next choice, which is then "stop"."""
  deadline = time.monotonic() + secs
  slice_secs = _PEER_STOP_POLL_SECS if multihost.is_multiprocess() else secs
  while (left := deadline - time.monotonic()) > 0:
    if preemption.wait_for_stop(min(left, slice_secs)) or _stop_evaluating():
      return


def _agreed(decision: int, choose) -> tuple[str, str | None]:
  """The chief's `choose()` for the `decision`-th wait, on every process: they restore
  and evaluate together (collectives), so take the same checkpoints in the same order."""
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
  """Whether every process restored the `decision`-th choice at one `step` (None here:
  lost a race with the trainer's rotation); if not, all go on to the next choice."""
  steps = agreement.exchange(f"eval_restored/{decision}", json.dumps(step))
  return step is not None and steps is not None and len(set(steps)) == 1


def _stop_evaluating() -> bool:
  """Whether a stop was requested here or, with several processes, in any of them
  (the first asked writes it in the key-value store, where the chief looks)."""
  if not multihost.is_multiprocess():
    return preemption.stop_requested()
  if preemption.stop_requested():
    agreement.key_value_set(agreement.run_key(_EVAL_STOP_KEY), str(jax.process_index()),
                            allow_existing=True)
    return True
  return agreement.key_value_try_get(agreement.run_key(_EVAL_STOP_KEY)) is not None
