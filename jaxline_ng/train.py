"""Training: state and periodic actions set up around the experiment's `train_loop`,
alone or on a thread beside evaluation (`train.evaluate` is jaxline's name for it)."""

import json
import os
import threading
import time
from collections.abc import Sequence

import jax
from absl import logging

from jaxline_ng import (
  base_config,
  checkpointing,
  debugging,
  errors,
  guards,
  iterator_state,
  loop_actions,
  multihost,
  periodic,
  preemption,
  profiling,
  rng,
  run_record,
  watchdog,
  writers,
  xla_cpu,
)
from jaxline_ng import experiment as experiment_lib
from jaxline_ng import mesh as mesh_lib
from jaxline_ng.evaluation import evaluate

# train_eval_multithreaded's evaluator looks often: an in-memory checkpoint costs nothing to see.
MULTITHREADED_EVAL_POLL_SECS = 0.2


class StepExitError(RuntimeError, errors.OneLineError):
  """`sys.exit()` was called inside the training loop (by `step` or a library it
  calls): a failure, not a finished run, which exit code 0 would report."""


@debugging.disable_pmap_jit  # As jaxline's: for callers other than platform.main.
def train(experiment_class, config, checkpointer, writer,
          periodic_actions: Sequence[periodic.PeriodicAction] = ()) -> None:
  """Trains `experiment_class` until its `should_run_step` says stop.

  Resumes from the `latest` series if it has a checkpoint; saves periodically
  and at the end. On a stop request (`preemption`) the loop ends after the
  current step, saves and flushes as at a normal end, then raises
  `preemption.Preempted`.
  """
  base_config.add_keys_beyond_jaxline(config)
  checkpointer = checkpointing.adapt(checkpointer)
  every_host_saves = checkpointing.every_host_saves(
      checkpointer, "train_checkpoint_all_hosts", config)
  save_checkpoints = multihost.is_chief() or every_host_saves
  _check_saves_agree(config, checkpointer, every_host_saves)
  mesh_lib.activate(config)
  multihost.own_collectives()

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
  resumed = checkpointer.can_be_restored("latest")
  if resumed:
    with experiment_lib.log_activity("checkpoint restore"):
      checkpointer.restore("latest")
    saved_config = getattr(state, "run_config", None) if checkpointer.keeps_run_entries else None
    if saved_config and (changed := run_record.differences(json.loads(saved_config),
                                                           json.loads(run_config))):
      if config.strict_resume_config:
        raise base_config.ConfigError(
            "config.strict_resume_config: the checkpoint was made with a different config: "
            + "; ".join(changed))
      logging.warning("[jaxline_ng] Resuming with a config that differs from the checkpoint's:"
                      "\n  %s", "\n  ".join(changed))
    started_from = checkpointer.started_from
    if started_from and not experiment.should_run_step(state.global_step, config):
      raise base_config.ConfigError(
          f"config.restore_path: the run starts from {started_from} at step "
          f"{state.global_step}, where its training ends (training_steps="
          f"{config.training_steps}); steps count on from the checkpoint's, so set "
          f"training_steps above {state.global_step}")
    if not experiment.should_run_step(state.global_step, config):  # Else it looks trained.
      logging.warning("[jaxline_ng] Restored step %d, where this run's training ends "
                      "(training_steps=%s): no step to train.", state.global_step,
                      config.training_steps)
  # After the restore, which builds the entries a fresh experiment leaves to `step`.
  logging.info("[jaxline_ng] Checkpointed state: %s",
               experiment_lib.describe_state(state.experiment_module))
  # Else processes would train from different steps, and wait on each other's saves.
  multihost.check_same_as_chief(
      "resumed", lambda: {"from step": int(state.global_step)},
      "every process must see the same checkpoints: give them one shared checkpoint_dir")
  if checkpointer.keeps_run_entries:
    state.run_config = run_config
  run_writer = writers.adapt(writer)  # None where this process writes nothing.
  if run_writer is not None:  # Rows past the checkpoint are redone: the old ones go.
    run_writer.resume(state.global_step)

  guard = guards.NonFiniteGuard(config.non_finite_policy, start_step=state.global_step)
  # The chief's saves wait for the other processes' guards, unless every process saves.
  peer_checks = None
  if multihost.is_multiprocess() and not every_host_saves:
    peer_checks = guards.PeerChecks(guard)
    if not save_checkpoints:
      peer_checks.answer()
  differing_copies = loop_actions.DifferingCopies(
      state.experiment_module if save_checkpoints else None)
  peer_positions = None
  if multihost.is_multiprocess() and not checkpointer.in_memory_only:
    peer_positions = iterator_state.PeerPositions(config, state.experiment_module)
  saves = save_checkpoints or bool(peer_positions and peer_positions.names)
  default_actions, save_latest = loop_actions.default_periodic_actions(
      config, checkpointer, run_writer, state, save_checkpoints, guard, differing_copies,
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
  actions = (loop_actions.FirstStepChecks(state.experiment_module if save_checkpoints else None,
                              differing_copies),
             *periodic_actions, *own_actions)
  if config.save_initial_train_checkpoint and saves and not resumed:
    save_latest()

  preempted = None
  try:
    try:
      state.experiment_module.train_loop(config, state, actions, writer)
    except preemption.Preempted as e:
      logging.warning("[jaxline_ng] %s: saving and exiting.", e)
      if threading.current_thread() is threading.main_thread():  # Else the evaluator's to see.
        preemption.consume_stop_request()
      preempted = e
    except SystemExit as e:
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
    # Rows and saves made before the error still land (the guard vetoes any it covers).
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

  try:
    checkpointer.wait_for_checkpointing_to_finish()
    if run_writer is not None:
      run_writer.flush()
    # The other processes answer the chief's checks until it has saved.
    multihost.rendezvous("jaxline_ng_train_end")
  finally:
    stuck_steps.close()
  if peer_checks is not None:
    peer_checks.close()
  if preempted is not None:
    if checkpointer.in_memory_only:
      logging.warning("[jaxline_ng] The checkpoints are in memory: a rerun starts afresh, so "
                      "the exit code is %d, not %d (--config.checkpointer=disk keeps them and "
                      "exits %d).", preemption.EXIT_STOPPED_UNSAVED, preemption.EXIT_PREEMPTED,
                      preemption.EXIT_PREEMPTED)
    raise preempted


def _check_saves_agree(config, checkpointer, every_host_saves: bool) -> None:
  """Refuses periodic saves by seconds where every process saves: each would read its
  own clock, and save (and so resume) after another step, as jaxline refused."""
  checkpoint_type = loop_actions.interval_type(config, "checkpoint_interval_type")
  if checkpoint_type == "steps" or config.save_checkpoint_interval <= 0:
    return
  if checkpointer.every_process_saves:
    why = ("every process of this multi-process mesh run writes its shards of each save, so "
           "all must save after the same step")
  elif multihost.is_multiprocess() and every_host_saves and not checkpointer.in_memory_only:
    why = (f"with config.train_checkpoint_all_hosts=True each process saves its own, and "
           f"{checkpointer.class_name} would resume each from another step")
  else:
    return
  culprit = "checkpoint_interval_type" if config.checkpoint_interval_type else "interval_type"
  raise base_config.ConfigError(
      f"config.{culprit}={checkpoint_type!r} times saves by each process's own clock, but "
      f"{why}: set config.checkpoint_interval_type='steps' and config.save_checkpoint_interval "
      "to a number of steps")


@debugging.disable_pmap_jit  # As jaxline's: for callers other than platform.main.
def train_eval_multithreaded(experiment_class, config, checkpointer, writer,
                             eval_writer=None, eval_checkpointer=None) -> None:
  """Trains on a background thread while the main thread evaluates (mode as jaxline's).

  If training raises, evaluation stops after the one in progress and the
  training error is raised here (jaxline hung forever). The evaluator
  restores through `eval_checkpointer` (default `checkpointer`).

  Raises:
    base_config.ConfigError: with several processes, whose two threads'
      collectives would reach the devices in another order in each process.
  """
  if multihost.is_multiprocess():
    raise base_config.ConfigError(
        f"--jaxline_mode=train_eval_multithreaded over {jax.process_count()} processes: the "
        "evaluator's collectives would interleave with training's in another order in each "
        "process and abort the run; run --jaxline_mode=eval as a job of its own beside training")
  checkpointer = checkpointing.adapt(checkpointer)
  if eval_writer is not None and not checkpointer.can_be_restored("latest"):  # As `train`'s.
    writers.adapt(eval_writer).resume(0)
  training_errors: list[BaseException] = []

  def run_training():
    try:
      train(experiment_class, config, checkpointer, writer)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised on the main thread)
      training_errors.append(e)
      if not preemption.stop_requested():  # The evaluator ends after its evaluation.
        preemption.request_stop("the training thread's failure")

  trainer = threading.Thread(target=run_training, name="jaxline_ng_train", daemon=True)
  trainer.start()
  # The trainer is waited for, so its last save lands; the evaluation's error is raised.
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
