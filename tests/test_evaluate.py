"""The evaluation loop and best-metric checkpointing."""

import json
import os
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxline_ng import (
  base_config,
  checkpointing,
  evaluation,
  experiment,
  preemption,
  run_lock,
  train,
  utils,
  writers,
)


def make_config(**overrides):
  config = base_config.get_base_config()
  config.training_steps = 10
  for key, value in overrides.items():
    config[key] = value
  return config


class Scripted(experiment.AbstractExperiment):
  """`evaluate` returns `metric/score = SCORES[global_step]` and records calls."""
  CHECKPOINT_ATTRS = {"_w": "w"}
  NON_BROADCAST_CHECKPOINT_ATTRS = {"_notes": "notes"}
  SCORES = {}
  calls = []
  best_calls = []

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._w = utils.bcast_local_devices(jnp.zeros(2))
    self._notes = {"mode": mode}

  def step(self, **unused):
    return {}

  def evaluate(self, global_step, rng, writer):
    # jaxline's evaluate got the step replicated on the devices (`bcast_local_devices`).
    assert isinstance(global_step, jax.Array) and global_step.shape == (jax.local_device_count(),)
    step = int(utils.get_first(global_step))
    Scripted.calls.append((step, np.asarray(rng), float(utils.get_first(self._w)[0])))
    return {"metric/score": self.SCORES[step], "other": 1.0}

  def on_new_best_model(self, best_state):
    Scripted.best_calls.append((best_state.global_step, best_state.best_eval_metric_value))


def save_latest(checkpointer, step):
  """Publishes a `latest` checkpoint for `step` from another thread, as a trainer does.

  Each thread has its own live state, so the evaluator's is left alone.
  """

  def publish():
    state = checkpointer.get_experiment_state("latest")
    module = Scripted("train", None)
    module._w = utils.bcast_local_devices(jnp.full(2, float(step)))
    state.global_step, state.experiment_module = step, module
    state.train_step_rng = utils.bcast_local_devices(jnp.full(2, step, jnp.uint32))
    checkpointer.save("latest")
    checkpointer.wait_for_checkpointing_to_finish()

  trainer = threading.Thread(target=publish)
  trainer.start()
  trainer.join()


def run_eval(config, checkpointer, steps):
  """Saves a checkpoint per step, evaluating after each, like a following eval job."""
  Scripted.calls, Scripted.best_calls = [], []
  for step in steps:
    save_latest(checkpointer, step)
    train.evaluate(Scripted, config, checkpointer, None, jaxline_mode="eval",
                   poll_interval_secs=0.01, stop_waiting=lambda: True)


@pytest.mark.parametrize("higher_is_better,scores,expected_best", [
    (True, {2: 0.5, 4: 0.4, 6: 0.5, 8: 0.7, 10: 0.7}, [(2, 0.5), (8, 0.7)]),
    (False, {2: 0.5, 4: 0.4, 6: 0.5, 8: 0.3, 10: 0.3}, [(2, 0.5), (4, 0.4), (8, 0.3)]),
])
def test_best_saved_exactly_on_strict_improvement(higher_is_better, scores, expected_best):
  Scripted.SCORES = scores
  config = make_config(best_model_eval_metric="metric/score",
                       best_model_eval_metric_higher_is_better=higher_is_better,
                       max_checkpoints_to_keep=10)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  run_eval(config, checkpointer, sorted(scores))
  best = utils.GLOBAL_CHECKPOINT_DICT["best"].history
  assert [(s.pickle_nest["global_step"], s.pickle_nest["best_eval_metric_value"])
          for s in best] == expected_best
  # The best checkpoint holds the weights that were evaluated.
  assert [float(s.pickle_nest["experiment_module"]["w"][0]) for s in best] == \
      [float(step) for step, _ in expected_best]
  # And, as jaxline's best state, the key chain of the checkpoint evaluated.
  assert [int(np.asarray(s.pickle_nest["train_step_rng"])[0, 0]) for s in best] == \
      [step for step, _ in expected_best]
  # Best value survives a restart: a fresh evaluator does not re-save a worse score.
  assert Scripted.best_calls[-1] == expected_best[-1]


def test_best_value_kept_across_evaluator_restarts():
  Scripted.SCORES = {3: 0.9, 10: 0.8}
  config = make_config(best_model_eval_metric="metric/score")
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  run_eval(config, checkpointer, [3])
  run_eval(config, checkpointer, [10])  # A new evaluator: must remember 0.9.
  assert len(utils.GLOBAL_CHECKPOINT_DICT["best"].history) == 1
  assert Scripted.best_calls == []


def test_a_best_past_the_first_evaluation_is_kept_by_a_checkpointer_that_cannot_set_it_aside(
    caplog):
  """A checkpointer of the user's may hold one best: starting afresh would overwrite it."""
  Scripted.SCORES = {6: 0.9, 4: 0.5}
  config = make_config(best_model_eval_metric="metric/score")
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  run_eval(config, checkpointer, [6])
  caplog.set_level("WARNING")
  run_eval(config, checkpointer, [4])  # `latest` rolled back: the newest is step 4 now.
  assert [s.pickle_nest["global_step"] for s in utils.GLOBAL_CHECKPOINT_DICT["best"].history] \
      == [6]
  assert ("The best checkpoint (metric/score=0.9 at step 6) is past step 4, evaluated first: "
          "kept, so this run's best must beat it.") in caplog.text


def test_a_best_series_of_another_metric_is_refused_naming_both():
  """The best value restored is the metric's it was saved for: compared with
  another metric's values, better checkpoints went unsaved."""
  Scripted.SCORES = {2: 0.5, 4: 0.1}
  checkpointer = checkpointing.InMemoryCheckpointer(make_config(), "eval")
  run_eval(make_config(best_model_eval_metric="other"), checkpointer, [2])  # other=1.0
  with pytest.raises(base_config.ConfigError,
                     match="best_model_eval_metric='metric/score', but the best checkpoints .* "
                           "are the best 'other'"):
    run_eval(make_config(best_model_eval_metric="metric/score"), checkpointer, [4])
  assert len(utils.GLOBAL_CHECKPOINT_DICT["best"].history) == 1


def test_nan_metric_never_becomes_best():
  Scripted.SCORES = {4: float("nan"), 10: float("nan")}
  config = make_config(best_model_eval_metric="metric/score")
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  run_eval(config, checkpointer, [4, 10])
  assert "best" not in utils.GLOBAL_CHECKPOINT_DICT or \
      not utils.GLOBAL_CHECKPOINT_DICT["best"].history


@pytest.mark.parametrize("all_hosts,saves", [(False, False), (True, True)])
def test_non_chief_saves_best_only_with_best_checkpoint_all_hosts(monkeypatch, all_hosts, saves):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  Scripted.SCORES = {10: 1.0}
  config = make_config(best_model_eval_metric="metric/score",
                       best_checkpoint_all_hosts=all_hosts)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  run_eval(config, checkpointer, [10])
  assert bool(utils.GLOBAL_CHECKPOINT_DICT.get("best") and
              utils.GLOBAL_CHECKPOINT_DICT["best"].history) == saves


def test_missing_best_metric_names_returned_keys():
  Scripted.SCORES = {10: 1.0}
  config = make_config(best_model_eval_metric="accuracy")
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  with pytest.raises(base_config.ConfigError, match=r"'accuracy'.*\['metric/score', 'other'\]"):
    run_eval(config, checkpointer, [10])


def test_each_checkpoint_evaluated_once_with_same_rng_and_stops_at_last_step():
  Scripted.SCORES = {0: 0.0, 5: 0.1, 10: 0.2}
  config = make_config(eval_initial_weights=True)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  Scripted.calls = []
  # Initial weights first (no checkpoint yet), then checkpoints 5 and 10.
  train.evaluate(Scripted, config, checkpointer, None, jaxline_mode="eval",
                 poll_interval_secs=0.01, stop_waiting=lambda: True)
  save_latest(checkpointer, 5)
  config.eval_initial_weights = False
  pending = iter([10])

  def publish_next():
    step = next(pending, None)
    if step is None:
      return True
    save_latest(checkpointer, step)
    return False

  train.evaluate(Scripted, config, checkpointer, None, jaxline_mode="eval",
                 poll_interval_secs=0.01, stop_waiting=publish_next)
  assert [step for step, _, _ in Scripted.calls] == [0, 5, 10]
  assert [w for _, _, w in Scripted.calls] == [0.0, 5.0, 10.0]
  rngs = [r for _, r, _ in Scripted.calls]
  assert rngs[0].shape == (jax.local_device_count(), 2)
  for r in rngs[1:]:
    np.testing.assert_array_equal(r, rngs[0])
  # random_mode_eval defaults to same_host_same_device.
  assert (rngs[0] == rngs[0][0]).all()


def _evaluate_or_stop_after(config, checkpointer, secs):
  """Evaluates as an eval job does (no `stop_waiting`); a stop request ends a
  wait still going after `secs`. Returns whether that was needed."""
  timer = threading.Timer(secs, preemption.request_stop, args=("the test",))
  timer.start()
  try:
    train.evaluate(Scripted, config, checkpointer, None, jaxline_mode="eval",
                   poll_interval_secs=0.01)
    return False
  except preemption.Preempted:
    return True
  finally:
    timer.cancel()
    preemption.consume_stop_request()


def test_an_eval_job_stops_at_the_step_its_finished_training_run_ended_at(tmp_path):
  """The trainer was launched with `--config.training_steps=4`, the eval job
  without it: no checkpoint after step 4 will come."""
  Scripted.SCORES = {4: 0.5}
  trainer_config = make_config(training_steps=4, checkpoint_dir=str(tmp_path))
  checkpointer = checkpointing.InMemoryCheckpointer(trainer_config, "train")
  train.train(Scripted, trainer_config, checkpointer, None)
  Scripted.calls = []
  eval_config = make_config(training_steps=10, checkpoint_dir=str(tmp_path))
  assert not _evaluate_or_stop_after(eval_config, checkpointer, 30)
  assert [step for step, _, _ in Scripted.calls] == [4]
  # A training run holding the directory (extending that run) is waited for.
  Scripted.calls = []
  with run_lock.held(str(tmp_path), "train"):
    assert _evaluate_or_stop_after(eval_config, checkpointer, 1)
  assert [step for step, _, _ in Scripted.calls] == [4]


def test_an_eval_job_stopping_at_its_own_training_steps_says_the_run_goes_on(tmp_path, caplog):
  # As jaxline it stops there, but it stopped in silence while training went on.
  Scripted.SCORES, Scripted.calls = {4: 0.5}, []
  trainer_config = make_config(training_steps=4, checkpoint_dir=str(tmp_path))
  checkpointer = checkpointing.InMemoryCheckpointer(trainer_config, "train")
  train.train(Scripted, trainer_config, checkpointer, None)
  nest = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest
  nest["run_config"] = json.dumps(dict(json.loads(nest["run_config"]), training_steps=60))
  eval_config = make_config(training_steps=3, checkpoint_dir=str(tmp_path))
  assert not _evaluate_or_stop_after(eval_config, checkpointer, 30)
  assert [step for step, _, _ in Scripted.calls] == [4]
  assert ("Step 4 ends this job's training_steps=3; the run that saved it trains to 60 (give "
          "the eval job --config.training_steps=60 to follow it)") in caplog.text


def test_an_eval_job_waits_for_a_trainer_that_takes_the_lock_soon_after(tmp_path, monkeypatch,
                                                                          caplog):
  """A relaunch extending the finished run was submitted with the eval job
  and takes a moment to start: one poll without it does not end the job."""
  Scripted.SCORES = {4: 0.5}
  trainer_config = make_config(training_steps=4, checkpoint_dir=str(tmp_path))
  checkpointer = checkpointing.InMemoryCheckpointer(trainer_config, "train")
  train.train(Scripted, trainer_config, checkpointer, None)
  polls = []

  def holder(*_):  # None at the first poll, then the relaunched trainer.
    polls.append(None)
    if len(polls) == 3:  # Waited for it: done (a timer raced a slow first evaluation).
      preemption.request_stop("the test")
    return None if len(polls) == 1 else "process 7 on host h"

  monkeypatch.setattr(run_lock, "holder", holder)
  eval_config = make_config(training_steps=10, checkpoint_dir=str(tmp_path))
  caplog.set_level("INFO", logger="absl")  # Another test may have set absl's own level.
  assert _evaluate_or_stop_after(eval_config, checkpointer, 60)
  assert "but process 7 on host h holds its train lock" in caplog.text


def test_train_eval_multithreaded_extending_a_finished_run_evaluates_to_its_end(tmp_path):
  """The first checkpoint the evaluator sees is the finished run's: its trainer is extending it."""
  Scripted.SCORES = {step: 0.0 for step in range(11)}
  checkpointer = checkpointing.InMemoryCheckpointer(make_config(), "train")
  train.train(Scripted, make_config(training_steps=4, checkpoint_dir=str(tmp_path)),
              checkpointer, None)
  Scripted.calls = []
  config = make_config(training_steps=10, checkpoint_dir=str(tmp_path), interval_type="steps",
                       save_checkpoint_interval=3)
  train.train_eval_multithreaded(Scripted, config, checkpointer, None)
  assert [step for step, _, _ in Scripted.calls][-1] == 10


def test_one_off_evaluate_stops_after_one():
  Scripted.SCORES = {5: 0.1}
  config = make_config(one_off_evaluate=True)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  run_eval(config, checkpointer, [5])
  assert [step for step, _, _ in Scripted.calls] == [5]


def test_non_broadcast_attrs_restored_whole():
  Scripted.SCORES = {10: 0.0}
  config = make_config()
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  run_eval(config, checkpointer, [10])
  state = checkpointer.get_experiment_state("latest")
  assert state.experiment_module._notes == {"mode": "train"}


def test_infinite_metric_never_becomes_best():
  Scripted.SCORES = {4: 0.5, 10: float("inf")}
  config = make_config(best_model_eval_metric="metric/score", max_checkpoints_to_keep=10)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  run_eval(config, checkpointer, [4, 10])
  assert [s.pickle_nest["global_step"] for s in utils.GLOBAL_CHECKPOINT_DICT["best"].history] \
      == [4]


def test_one_off_evaluate_without_a_checkpoint_is_one_line_not_a_wait():
  # jaxline raises at once too: a one-off evaluation has nothing coming.
  config = make_config(one_off_evaluate=True)
  with pytest.raises(base_config.ConfigError, match="^config.one_off_evaluate=True but "
                     f"{config.checkpoint_dir} has no checkpoint to evaluate"):
    train.evaluate(Scripted, config, checkpointing.InMemoryCheckpointer(config, "eval"), None,
                   jaxline_mode="eval", poll_interval_secs=0.01, stop_waiting=lambda: True)


def test_an_eval_job_waiting_long_for_a_first_checkpoint_says_so(monkeypatch, caplog):
  # A mistyped checkpoint_dir: no trainer will come, and jaxline waited in silence.
  monkeypatch.setattr(evaluation, "_NO_CHECKPOINT_REMINDER_SECS", 0.02)
  polls = iter(range(5))

  class Empty:
    def restore_path(self, series):
      del series

  action, _ = evaluation._next_checkpoint(  # pylint: disable=protected-access
      Empty(), (None,), False, lambda: next(polls, None) is None, poll_interval_secs=0.01)
  assert action == "done"
  assert "Still no checkpoint to restore after 0 min (restore path: None): is a training run " \
      "saving to this " \
      "config.checkpoint_dir?" in caplog.text


class OneFileCheckpointer:
  """A checkpointer that overwrites one file at each save, as tapnet's
  `NumpyFileCheckpointer` does: its `restore_path` is always the same."""

  def __init__(self, path):
    self.path = str(path)
    self._state = ml_collections.ConfigDict()  # jaxline's kind of live state

  def publish(self, step):
    """What the trainer's save does: a new file replaces the old one."""
    np.save(self.path + ".tmp.npy", np.full(2, float(step)))
    os.replace(self.path + ".tmp.npy", self.path)
    self.step = step

  def get_experiment_state(self, ckpt_series):
    return self._state

  def can_be_restored(self, ckpt_series):
    return os.path.exists(self.path)

  def restore(self, ckpt_series):
    self._state.global_step = self.step
    self._state.experiment_module._w = utils.bcast_local_devices(jnp.asarray(np.load(self.path)))

  def restore_path(self, ckpt_series):
    return self.path if self.can_be_restored(ckpt_series) else None

  def wait_for_checkpointing_to_finish(self):
    pass


def test_an_evaluator_follows_a_checkpointer_that_overwrites_one_file(tmp_path):
  """Comparing paths alone, the evaluator took each save for the one it had
  evaluated: an eval job beside tapnet's training waited forever."""
  Scripted.SCORES = {4: 0.1, 10: 0.2}
  checkpointer = OneFileCheckpointer(tmp_path / "checkpoint.npy")
  checkpointer.publish(4)
  assert evaluated_while_publishing(checkpointer, [10]) == [(4, 4.0), (10, 10.0)]


def evaluated_while_publishing(checkpointer, saves):
  """Evaluates, publishing the next of `saves` whenever the evaluator waits,
  then stopping; returns the (step, weight) pairs evaluated."""
  Scripted.calls = []
  saves_to_come = list(reversed(saves))

  def next_save_or_stop():  # Called while the evaluator waits for a new checkpoint.
    if not saves_to_come:
      return True
    checkpointer.publish(saves_to_come.pop())
    return False

  train.evaluate(Scripted, make_config(), checkpointer, None, jaxline_mode="eval",
                 poll_interval_secs=0.01, stop_waiting=next_save_or_stop)
  return [(step, w) for step, _, w in Scripted.calls]


class NamesItsFileAhead(OneFileCheckpointer):
  """`restore_path` names the file before the first save writes it, as a
  user's checkpointer may: only `can_be_restored` says it is there."""

  def restore_path(self, ckpt_series):
    return self.path


def test_an_evaluator_waits_until_the_checkpoint_named_can_be_restored(tmp_path):
  # jaxline polled until `can_be_restored("latest")`: restoring the named file
  # at once raised FileNotFoundError in an evaluator started before its trainer.
  Scripted.SCORES = {4: 0.1}
  checkpointer = NamesItsFileAhead(tmp_path / "checkpoint.npy")
  assert evaluated_while_publishing(checkpointer, [4]) == [(4, 4.0)]


class NamesNoFile(OneFileCheckpointer):
  """`restore_path` names nothing though the checkpoint can be restored."""

  def restore_path(self, ckpt_series):
    return None


@pytest.mark.parametrize("eval_initial_weights", [False, True])
def test_a_one_off_evaluation_restores_what_can_be_restored_whatever_its_path(
    tmp_path, eval_initial_weights):
  # As jaxline, which asked `can_be_restored` alone: it waited forever, or
  # evaluated the initial weights instead of the checkpoint.
  Scripted.SCORES, Scripted.calls = {4: 0.1}, []
  checkpointer = NamesNoFile(tmp_path / "checkpoint.npy")
  checkpointer.publish(4)
  train.evaluate(Scripted, make_config(one_off_evaluate=True,
                                       eval_initial_weights=eval_initial_weights),
                 checkpointer, None, jaxline_mode="eval", poll_interval_secs=0.01,
                 stop_waiting=lambda: True)
  assert [(step, w) for step, _, w in Scripted.calls] == [(4, 4.0)]


def test_a_one_off_evaluation_of_a_checkpoint_not_restorable_evaluates_initial_weights(tmp_path):
  # As jaxline: `one_off_evaluate` restores only what `can_be_restored`, else
  # evaluates the initial weights when asked to, else refuses.
  Scripted.SCORES, Scripted.calls = {0: 0.1}, []
  checkpointer = NamesItsFileAhead(tmp_path / "checkpoint.npy")
  train.evaluate(Scripted, make_config(one_off_evaluate=True, eval_initial_weights=True),
                 checkpointer, None, jaxline_mode="eval")
  assert [(step, w) for step, _, w in Scripted.calls] == [(0, 0.0)]
  with pytest.raises(base_config.ConfigError, match="has no checkpoint to evaluate"):
    train.evaluate(Scripted, make_config(one_off_evaluate=True), checkpointer, None,
                   jaxline_mode="eval")


def test_an_eval_job_sets_an_earlier_runs_rows_aside_and_redoes_its_own(tmp_path):
  # An earlier run evaluated up to step 500; this one restarted afresh and has
  # a checkpoint at step 60: those rows are kept aside, not cut.
  path = tmp_path / "metrics.jsonl"
  earlier = b"".join(b'{"step": %d, "metric/score": 0.5}\n' % step for step in range(20, 501, 20))
  path.write_bytes(earlier)
  Scripted.SCORES = {60: 0.1}
  config = make_config(one_off_evaluate=True)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "eval")
  save_latest(checkpointer, 60)
  writer = writers.JsonlWriter(str(path))
  train.evaluate(Scripted, config, checkpointer, writer, jaxline_mode="eval")
  writer.close()
  aside = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.")]
  assert len(aside) == 1 and aside[0].read_bytes() == earlier
  assert [row["step"] for row in map(json.loads, path.read_text().splitlines())] == [60]

  # Its own row of that step, as when the job is restarted over the same checkpoint, is redone.
  writer = writers.JsonlWriter(str(path))
  train.evaluate(Scripted, config, checkpointer, writer, jaxline_mode="eval")
  writer.close()
  assert [row["step"] for row in map(json.loads, path.read_text().splitlines())] == [60]
  assert len([p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.")]) == 1
