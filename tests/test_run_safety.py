"""Run safety and insight: non-finite guard, time budget, profile window, run record."""

import dataclasses
import glob
import gzip
import json
import math
import os
import sys
import time

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import flagsaver

from jaxline_ng import (
  base_config,
  checkpointing,
  devices,
  disk_checkpointing,
  experiment,
  guards,
  platform,
  preemption,
  profiling,
  run_record,
  train,
  utils,
  writers,
)


class Exploding(experiment.AbstractExperiment):
  """`loss` goes NaN from the step called with global_step == BAD_FROM."""
  CHECKPOINT_ATTRS = {"_w": "w"}
  BAD_FROM = 5
  SLEEP = 0.0

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._w = utils.bcast_local_devices(jnp.zeros(()))
    bad_from = self.BAD_FROM
    self._update = jax.pmap(
        lambda w, step: (w + 1.0, jnp.where(step >= bad_from, jnp.nan, 1.0 * step)),
        axis_name="i")

  def step(self, global_step, **unused):
    if self.SLEEP:
      time.sleep(self.SLEEP)
    self._w, loss = self._update(self._w, global_step)
    return {"loss": loss, "count": global_step}

  def evaluate(self, **unused):
    return {}


def make_config(**overrides):
  config = base_config.get_base_config()
  config.training_steps = 12
  config.interval_type = "steps"
  config.log_tensors_interval = 4
  config.log_train_data_interval = None
  config.save_checkpoint_interval = 1
  config.max_checkpoints_to_keep = 100
  for key, value in overrides.items():
    config[key] = value
  return config


def run(config, cls=Exploding):
  train.train(cls, config, checkpointing.InMemoryCheckpointer(config, "train"), None)


def latest_step():
  return utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest["global_step"]


def test_halt_names_first_bad_step_and_keeps_last_finite_checkpoint():
  with pytest.raises(guards.NonFiniteError, match=r"loss at step 6 \(the step called with "
                                                  r"global_step=5\)"):
    run(make_config())
  assert latest_step() == 5
  nest = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest
  assert float(nest["experiment_module"]["w"]) == 5.0


def test_halt_without_per_step_checkpoints_still_names_first_bad_step():
  with pytest.raises(guards.NonFiniteError, match="at step 6 "):
    run(make_config(save_checkpoint_interval=1000, log_tensors_interval=1000))
  # Nothing after the bad step was saved: no final checkpoint either.
  assert "latest" not in utils.GLOBAL_CHECKPOINT_DICT or \
      not utils.GLOBAL_CHECKPOINT_DICT["latest"].history


class ExplodingLate(Exploding):
  BAD_FROM = 37


def test_halt_names_the_first_bad_step_long_after_the_last_check():
  with pytest.raises(guards.NonFiniteError, match="at step 38 "):
    run(make_config(training_steps=100, save_checkpoint_interval=10**6,
                    log_tensors_interval=90, periodic_action_growth_ratios=None),
        ExplodingLate)


def test_a_sealed_check_covers_exactly_the_steps_before_it():
  guard = guards.NonFiniteGuard("halt")
  double = jax.pmap(lambda x: 2.0 * x, axis_name="i")
  ones = utils.bcast_local_devices(jnp.float32(1.0))
  for step in range(1, 11):
    guard(0.0, step, {"loss": double(ones)})
  before_nan = guard.seal()
  guard(0.0, 11, {"loss": double(ones * jnp.nan)})
  after_nan = guard.seal()
  before_nan()  # A save at step 10 is not vetoed by step 11.
  with pytest.raises(guards.NonFiniteError, match="loss at step 11 "):
    after_nan()
  with pytest.raises(guards.NonFiniteError):
    guard(0.0, 12, {"loss": double(ones)})


def test_a_peer_answers_at_once_for_the_step_it_resumed_at():
  """A finished multi-process run launched again runs no step; the chief's
  final save of the restored step waits for each peer's verdict on it."""
  guard = guards.NonFiniteGuard("halt", start_step=10)
  deadline = time.monotonic() + 5
  assert guard.verdict_through(10, give_up=lambda: time.monotonic() > deadline) == "ok"
  assert time.monotonic() < deadline


def test_warn_logs_each_bad_step_once_when_two_checks_cover_it(caplog):
  """The loop's final check and the disk checkpointer's check of the final
  save cover the same steps; "warn" logged the last bad step twice."""
  guard = guards.NonFiniteGuard("warn")
  for step in range(1, 5):
    guard(0.0, step, {"loss": jnp.float32(np.nan if step >= 3 else 1.0)})
  save_check = guard.seal()
  guard.check()
  save_check()
  assert caplog.text.count("at step 3 ") == 1
  assert caplog.text.count("at step 4 ") == 1


def test_warn_logs_the_first_bad_steps_then_every_power_of_ten(caplog):
  # A run that stays non-finite logged a line at every step.
  guard = guards.NonFiniteGuard("warn")
  for step in range(1, 1001):
    guard(0.0, step, {"loss": float("nan")})
    guard.check()
  warned = [line for line in caplog.text.splitlines() if "non_finite_policy='warn'" in line]
  assert len(warned) == 12
  assert "at step 100 " in warned[10] and "at step 1000 " in warned[11]
  assert "non-finite step 10 of the run, the next reported at the 100th" in warned[9]


def test_a_nan_on_another_device_is_named_once_it_reaches_the_first():
  guard = guards.NonFiniteGuard("halt")
  only_last = np.ones(jax.local_device_count(), np.float32)
  only_last[-1] = np.nan
  guard(0.0, 1, {"loss": devices.put_per_device(np.ones_like(only_last))})
  guard(0.0, 2, {"loss": devices.put_per_device(only_last)})
  guard(0.0, 3, {"loss": devices.put_per_device(np.full_like(only_last, np.nan))})
  with pytest.raises(guards.NonFiniteError, match="loss at step 2 "):
    guard.check()


def test_logged_values_reveal_a_bad_step_to_the_loop():
  guard = guards.NonFiniteGuard("halt")
  for step in range(1, 6):
    guard(0.0, step, {"loss": jnp.float32(np.nan if step >= 3 else 1.0)})
  guard.observe(5, {"loss": float("nan")})
  with pytest.raises(guards.NonFiniteError, match="loss at step 3 "):
    guard(0.0, 6, {"loss": jnp.float32(np.nan)})


def test_a_bad_step_logged_beside_good_ones_is_reported():
  """Logging reads several steps at once: a finite step observed after the bad
  one made the guard forget the bad one before the loop looked."""
  guard = guards.NonFiniteGuard("halt")
  for step in range(1, 6):
    guard(0.0, step, {"loss": jnp.float32(np.nan if step == 3 else 1.0)})
  for step in range(1, 6):
    guard.observe(step, {"loss": float("nan") if step == 3 else 1.0})
  with pytest.raises(guards.NonFiniteError, match="loss at step 3 "):
    guard(0.0, 6, {"loss": jnp.float32(1.0)})


def test_a_bad_step_logged_after_a_check_passed_it_vetoes_the_next_save():
  """A save's check read a later, finite step and forgot the bad one; logging
  then read the bad one: the next save is refused, naming it."""
  guard = guards.NonFiniteGuard("halt")
  for step in range(1, 6):
    guard(0.0, step, {"loss": jnp.float32(np.nan if step == 3 else 1.0)})
  guard.check()  # Reads step 5 alone: finite.
  guard.observe(3, {"loss": float("nan")})
  with pytest.raises(guards.NonFiniteError, match="loss at step 3 "):
    guard.seal()()


class OneBadStep(Exploding):
  """`loss` is NaN at the step called with global_step == 5 only."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._update = jax.pmap(
        lambda w, step: (w + 1.0, jnp.where(step == 5, jnp.nan, 1.0 * step)), axis_name="i")


def test_halt_stops_at_a_single_bad_step_that_logging_wrote(tmp_path):
  config = make_config(save_checkpoint_interval=1000, log_tensors_interval=1,
                       log_train_data_interval=1, training_steps=40)
  writer = writers.make_writer(str(tmp_path))
  try:
    with pytest.raises(guards.NonFiniteError, match="loss at step 6 "):
      train.train(OneBadStep, config, checkpointing.InMemoryCheckpointer(config, "train"),
                  writer)
  finally:
    writer.close()


def test_scalars_that_change_from_step_to_step_are_checked_too():
  guard = guards.NonFiniteGuard("halt")
  guard(0.0, 1, {"loss": jnp.float32(1.0)})
  guard(0.0, 2, {"loss": jnp.float32(1.0), "grad_norm": jnp.float32(np.inf), "tag": "x"})
  with pytest.raises(guards.NonFiniteError, match="grad_norm at step 2 "):
    guard.check()


def test_non_finite_names_of_python_numbers_and_arrays():
  scalars = {"b_nan": float("nan"), "a_inf": -math.inf, "ok": 0.5, "count": 3, "flag": True,
             "np_nan": np.float32("nan"), "array_inf": np.array([1.0, np.inf]),
             "ints": np.array([1, 2])}
  assert guards.non_finite_names(scalars) == ["a_inf", "array_inf", "b_nan", "np_nan"]
  assert guards.non_finite_names({"loss": 1e300, "steps_per_sec": 1012.5}) == []


def test_warn_continues_and_off_is_silent(caplog):
  run(make_config(non_finite_policy="warn"))
  assert latest_step() == 12
  assert "non-finite training scalars loss at step 6" in caplog.text
  caplog.clear()
  utils.GLOBAL_CHECKPOINT_DICT.clear()
  run(make_config(non_finite_policy="off"))
  assert latest_step() == 12 and "non-finite" not in caplog.text


def test_non_finite_error_is_a_one_line_exit_from_the_platform(tmp_path):
  config = make_config(checkpoint_dir=str(tmp_path))
  with flagsaver.flagsaver(config=config, jaxline_mode="train"):
    with pytest.raises(SystemExit, match="jaxline_ng: error: non-finite training scalars"):
      platform.main(Exploding, [])


class Finite(Exploding):
  BAD_FROM = 10**9


class Slow(Finite):
  SLEEP = 0.05


def test_wall_clock_budget_stops_saved_and_resume_continues(caplog):
  config = make_config(training_steps=1000, save_checkpoint_interval=1000,
                       wall_clock_budget_secs=0.6)
  start = time.monotonic()
  with pytest.raises(preemption.Preempted, match="wall-clock budget of 0.6s"):
    run(config, Slow)
  assert time.monotonic() - start < 10
  # A rerun in another process would start afresh: its exit code does not ask for one.
  assert "The checkpoints are in memory: a rerun starts afresh, so the exit code is 143" \
      in caplog.text
  stopped_at = latest_step()
  assert 0 < stopped_at < 1000
  config.wall_clock_budget_secs = None
  config.training_steps = stopped_at + 3
  run(config, Slow)
  assert latest_step() == stopped_at + 3


def test_wall_clock_budget_exit_code_from_the_command_line(tmp_path):
  result = helpers.run(helpers.toy_command(
      tmp_path, "--config.training_steps=100000000", "--config.wall_clock_budget_secs=2",
      "--config.experiment_kwargs.config.step_sleep_secs=0.005"))  # Spares the suite's CPU.
  assert result.returncode == preemption.EXIT_PREEMPTED == 75, result.stderr[-2000:]
  assert "stopped by the wall-clock budget of 2s after step" in result.stderr
  # The step it stopped after is saved, and its row written.
  rows = helpers.read_jsonl(tmp_path / "train" / "metrics.jsonl")
  assert disk_checkpointing.read(str(tmp_path))[0] == rows[-1]["step"] > 0


def test_profile_window_traces_exactly_the_chosen_steps(tmp_path):
  run(make_config(checkpoint_dir=str(tmp_path), profile_steps=(3, 6), training_steps=10), Finite)
  traces = glob.glob(str(tmp_path / "train" / "profile" / "plugins" / "profile" / "*" /
                         "*.trace.json.gz"))
  assert len(traces) == 1  # One trace session, for the window only.
  with gzip.open(traces[0]) as f:
    events = json.load(f)["traceEvents"]
  steps = {int(e["args"]["step_num"]) for e in events
           if e.get("name") == "train" and "step_num" in e.get("args", {})}
  assert steps == {3, 4, 5}


def test_a_profile_window_the_run_never_reaches_is_reported(tmp_path, caplog):
  run(make_config(checkpoint_dir=str(tmp_path), profile_steps=(30, 40), training_steps=10), Finite)
  assert "profile_steps=(30, 40) is outside the steps this run trained, 0 to 9" in caplog.text
  assert not os.path.exists(tmp_path / "train" / "profile")


def test_a_resumed_profile_window_reports_the_steps_it_traced(tmp_path, caplog):
  """A run resumed at step 20 inside the window (5, 25) traces steps 20 to 24, not 5 to 24;
  one resumed at its last step trains none."""
  caplog.set_level("INFO", logger="absl")  # Another test may have set absl's own level.
  window = profiling.ProfileWindow(5, 25, str(tmp_path / "a"), steps_completed=20)
  window(0.0, 25, {})
  assert "Profile of steps 20 to 24 written" in caplog.text
  profiling.ProfileWindow(30, 40, str(tmp_path / "b"), steps_completed=20).finish()
  assert "outside this run, which trained no step (it began at 20)" in caplog.text


def test_run_record_contents(tmp_path):
  config = make_config(checkpoint_dir=str(tmp_path), non_finite_policy="off")
  config.my_key = "kept"
  path = run_record.write(config, "train", str(tmp_path / "train"))
  with open(path) as f:
    record = json.load(f)
  assert record["config"]["my_key"] == "kept"
  assert record["config"]["training_steps"] == 12
  assert record["versions"]["jax"] == jax.__version__
  assert record["devices"]["local_count"] == jax.local_device_count()
  assert record["processes"] == {"count": 1, "index": 0}
  assert record["command_line"] == sys.argv
  assert set(record) >= {"git", "started", "working_directory", "mode"}


def test_platform_writes_run_record(tmp_path):
  config = make_config(checkpoint_dir=str(tmp_path), non_finite_policy="off", training_steps=2)
  with flagsaver.flagsaver(config=config, jaxline_mode="train"):
    platform.main(Exploding, [])
  with open(tmp_path / "train" / "run.json") as f:
    assert json.load(f)["config"]["non_finite_policy"] == "off"


def test_resume_with_different_config_warns_or_refuses(caplog):
  run(make_config(non_finite_policy="off", training_steps=3))
  run(make_config(non_finite_policy="off", training_steps=5, log_tensors_interval=2))
  assert "log_tensors_interval: 4 -> 2" in caplog.text
  assert "training_steps: 3 -> 5" in caplog.text
  with pytest.raises(base_config.ConfigError, match="strict_resume_config.*training_steps"):
    run(make_config(non_finite_policy="off", training_steps=7, strict_resume_config=True))


def test_an_unchanged_config_is_no_difference_whatever_it_holds():
  def make_schedule():
    def schedule(step):
      return 0.1 * step
    return schedule

  # A resumed process builds the config anew: its function is another object,
  # at another address, with the same name and meaning.
  before = run_record.flat_config(make_config(lr_schedule=make_schedule(), checkpoint_dir="/a"))
  # Nor is where the run lives, or caches its compiled programs.
  after = run_record.flat_config(make_config(lr_schedule=make_schedule(), checkpoint_dir="/b",
                                             compilation_cache_dir="/cache",
                                             strict_resume_config=True))
  assert "lr_schedule" in before and " at 0x" not in before["lr_schedule"]
  assert run_record.differences(before, after) == []
  changed = run_record.flat_config(make_config(lr_schedule=print, checkpoint_dir="/a"))
  assert [line.split(":")[0] for line in run_record.differences(before, changed)] == [
      "lr_schedule"]


def test_each_launchs_record_is_kept(tmp_path):
  """A launch refused for a changed config wrote over the record of the one
  that made the checkpoints."""
  first = make_config(training_steps=20)
  run_record.write(first, "train", str(tmp_path))
  run_record.write(make_config(training_steps=40), "train", str(tmp_path))
  records = {}
  for path in glob.glob(str(tmp_path / "run*.json")):
    with open(path) as f:
      records[os.path.basename(path)] = json.load(f)["config"]["training_steps"]
  assert records.pop("run.json") == 40
  assert list(records.values()) == [20]


def test_config_values_with_an_items_attribute_are_values_not_mappings():
  """A class (`dict` itself) or a dataclass with a field named `items` is a
  value of the config; flattening called its `items` as a mapping's."""

  @dataclasses.dataclass
  class Split:
    items: tuple = (1, 2)

  flat = run_record.flat_config(make_config(klass=dict, split=Split()))
  assert flat["klass"] == "<class 'dict'>" and "Split(items=(1, 2))" in flat["split"]


def test_equal_sets_and_nans_are_no_difference():
  # A set iterates in an order its insertions (and, for strings, the
  # process's hash seed) decide; NaN is not equal to itself.
  first, second = {1}, {9}
  first.add(9)
  second.add(1)
  assert repr(first) != repr(second)
  before = run_record.flat_config(make_config(splits=first, clip=float("nan")))
  after = run_record.flat_config(make_config(splits=second, clip=float("nan")))
  assert run_record.differences(before, after) == []
  changed = run_record.flat_config(make_config(splits={1, 8}, clip=1.0))
  assert [line.split(":")[0] for line in run_record.differences(before, changed)] == [
      "clip", "splits"]


def test_a_long_value_that_differs_is_shown_where_it_differs():
  # jax_privacy's config holds a dataclass, whose repr runs to thousands of
  # characters; its dataset seed is drawn when the config is built.
  def config_repr(seed):
    return f"ExperimentConfig(optimizer={'x' * 2000}, data=Data(seed={seed}, {'y' * 2000}))"

  line, = run_record.differences({"experiment_kwargs.config": config_repr(1287556841)},
                                 {"experiment_kwargs.config": config_repr(3467877883)})
  assert "seed=1287556841" in line and "seed=3467877883" in line and len(line) < 300, line
  assert line.startswith("experiment_kwargs.config: '…")
