"""Durable checkpoints: format, atomicity, fallback, resume, restore_path."""

import collections
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxline_ng import (
  base_config,
  checkpoint_format,
  checkpoint_restore,
  devices,
  disk_checkpointing,
  errors,
  experiment,
  multihost,
  train,
  utils,
  writers,
)

Moments = collections.namedtuple("Moments", ["mean", "count"])


class Rich(experiment.AbstractExperiment):
  """Checkpoints arrays in NamedTuples and optax states, and plain Python values."""
  CHECKPOINT_ATTRS = {"_params": "params", "_opt_state": "opt_state", "_moments": "moments"}
  NON_BROADCAST_CHECKPOINT_ATTRS = {"_history": "history", "_info": "info", "_nothing": "nothing"}
  seen_steps = []

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    self._opt = optax.adam(0.1)
    self._params = utils.bcast_local_devices(params)
    self._opt_state = utils.bcast_local_devices(self._opt.init(params))
    self._moments = utils.bcast_local_devices(Moments(jnp.zeros(()), jnp.zeros((), jnp.int32)))
    self._history = []
    self._info = {"name": "rich", "scale": 1.5, "flags": (True, None), "seed": np.int64(7)}
    self._nothing = None

    def update(params, opt_state, moments, global_step):
      grads = jax.tree.map(lambda p: jnp.ones_like(p) * (global_step + 1), params)
      updates, opt_state = self._opt.update(grads, opt_state)
      return (optax.apply_updates(params, updates), opt_state,
              Moments(moments.mean + 1.0, moments.count + 1))

    self._update = jax.pmap(update, axis_name="i")

  def step(self, global_step, **unused):
    step = int(utils.get_first(global_step))
    Rich.seen_steps.append(step)
    self._params, self._opt_state, self._moments = self._update(
        self._params, self._opt_state, self._moments, global_step)
    self._history.append(step)
    return {"b0": utils.get_first(self._params)["b"][0]}

  def evaluate(self, **unused):
    return {"b0": utils.get_first(self._params)["b"][0]}


def disk_config(tmp_path, steps, **overrides):
  config = base_config.get_base_config()
  config.checkpointer = "disk"
  config.checkpoint_dir = str(tmp_path)
  config.training_steps = steps
  config.interval_type = "steps"
  config.save_checkpoint_interval = 2
  config.max_checkpoints_to_keep = 3
  for key, value in overrides.items():
    config[key] = value
  return config


def run(config):
  Rich.seen_steps = []
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  train.train(Rich, config, checkpointer, None)
  return checkpointer.get_experiment_state("latest").experiment_module


def train_to(experiment_class, tmp_path, steps):
  """Trains (or resumes) `experiment_class` on disk in `tmp_path` to `steps`; its experiment."""
  config = disk_config(tmp_path, steps)
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  train.train(experiment_class, config, checkpointer, None)
  return checkpointer.get_experiment_state("latest").experiment_module


@pytest.fixture(scope="module")
def rich_at_2_steps(tmp_path_factory):
  """A disk run of `Rich` trained to step 2, made once per module (see `trained_to_2`)."""
  path = tmp_path_factory.mktemp("rich_at_2_steps")
  run(disk_config(path, 2))
  return path


@pytest.fixture
def trained_to_2(tmp_path, rich_at_2_steps):
  """`tmp_path` holding a copy of `rich_at_2_steps`: what `run(disk_config(tmp_path, 2))` makes."""
  shutil.copytree(rich_at_2_steps, tmp_path, dirs_exist_ok=True)
  return tmp_path


def series_steps(tmp_path, series="latest"):
  return checkpoint_format.saved_steps(os.path.join(tmp_path, "checkpoints", series))


def test_resume_restores_every_attribute_in_its_structure(tmp_path):
  uninterrupted = run(disk_config(tmp_path / "a", 7))
  run(disk_config(tmp_path / "b", 4))
  resumed = run(disk_config(tmp_path / "b", 7))
  assert Rich.seen_steps == [4, 5, 6]
  assert resumed._history == [0, 1, 2, 3, 4, 5, 6]
  assert resumed._info == {"name": "rich", "scale": 1.5, "flags": (True, None), "seed": 7}
  assert isinstance(resumed._info["seed"], np.int64)  # A NumPy scalar, not a 0-d array.
  assert resumed._nothing is None
  assert isinstance(utils.get_first(resumed._moments), Moments)
  assert type(resumed._opt_state) is type(uninterrupted._opt_state)  # pylint: disable=unidiomatic-typecheck
  _assert_same_arrays((resumed._params, resumed._opt_state),
                      (uninterrupted._params, uninterrupted._opt_state))


def test_zero_size_arrays_are_saved_and_restored(tmp_path):
  """orbax refuses them; a model can hold one (an attention key size of 0)."""

  class WithEmpty(Rich):

    def __init__(self, mode, init_rng):
      super().__init__(mode, init_rng)
      self._moments = utils.bcast_local_devices(
          Moments(jnp.zeros(()), jnp.zeros((4, 0), jnp.bfloat16)))

    def step(self, **kwargs):
      return {"b0": utils.get_first(self._params)["b"][0]}

  config = disk_config(tmp_path, 2)
  train.train(WithEmpty, config, disk_checkpointing.DiskCheckpointer(config, "train"), None)
  config = disk_config(tmp_path, 3)
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  train.train(WithEmpty, config, checkpointer, None)
  assert series_steps(tmp_path) == [2, 3]
  empty = utils.get_first(checkpointer.get_experiment_state("latest").experiment_module._moments)
  assert empty.count.shape == (4, 0) and empty.count.dtype == jnp.bfloat16


def test_max_to_keep_and_no_duplicate_final_save(tmp_path):
  run(disk_config(tmp_path, 8))
  assert series_steps(tmp_path) == [4, 6, 8]


def test_unstorable_value_fails_at_first_save_naming_it(tmp_path):

  class Unstorable(Rich):

    def __init__(self, mode, init_rng):
      super().__init__(mode, init_rng)
      self._info = {"callback": print}

  config = disk_config(tmp_path, 3)
  with pytest.raises(disk_checkpointing.CheckpointFormatError,
                     match=r"experiment_module/info\['callback'\]"):
    train.train(Unstorable, config, disk_checkpointing.DiskCheckpointer(config, "train"), None)


def test_names_orbax_would_store_alike_fail_at_first_save_naming_both(tmp_path):
  """Orbax joins a path with '.': 'a.b' and a/b overwrote each other, the save
  succeeded, and every checkpoint of the run failed its checksums at restore."""

  class DottedKeys(Rich):

    def __init__(self, mode, init_rng):
      super().__init__(mode, init_rng)
      self._info = {"a.b": np.ones(2), "a": {"b": np.zeros(2)}}

  config = disk_config(tmp_path, 3)
  with pytest.raises(disk_checkpointing.CheckpointFormatError,
                     match=r"cannot checkpoint experiment_module/info\['a\.b'\]: orbax stores "
                           r"it as 'experiment_module\.info\.a\.b', as it does "
                           r"experiment_module/info/a/b;") as raised:
    train.train(DottedKeys, config, disk_checkpointing.DiskCheckpointer(config, "train"), None)
  assert isinstance(raised.value, errors.OneLineError)
  assert series_steps(tmp_path) == []


class TypedKeys(Rich):
  """Keeps typed PRNG keys (`jax.random.key`): one per device, and one whole."""
  CHECKPOINT_ATTRS = {**Rich.CHECKPOINT_ATTRS, "_device_keys": "device_keys"}
  NON_BROADCAST_CHECKPOINT_ATTRS = {**Rich.NON_BROADCAST_CHECKPOINT_ATTRS, "_key": "key",
                                    "_late_key": "late_key"}
  seen_rngs = []

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._key = jax.random.key(0)
    self._device_keys = utils.bcast_local_devices(jax.random.key(1))
    self._late_key = None  # Made by the first step, as jaxline experiments build state.

  def step(self, rng, **kwargs):
    if self._late_key is None:
      self._late_key = jax.random.key(2, impl="rbg")
    TypedKeys.seen_rngs.append(jax.random.key_data(rng))
    self._key = jax.random.split(self._key)[0]
    self._device_keys = jax.vmap(lambda k: jax.random.split(k)[0])(self._device_keys)
    return super().step(**kwargs)


def test_typed_prng_keys_resume_typed_and_exact(tmp_path):
  """Typed keys are saved as their raw data and come back typed; with
  `jax_enable_custom_prng` the chain itself is typed (jaxline's train_test)."""

  def run_keys(config):
    TypedKeys.seen_rngs = []
    checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
    with jax.enable_custom_prng(True):
      train.train(TypedKeys, config, checkpointer, None)
    return checkpointer.get_experiment_state("latest")

  uninterrupted = run_keys(disk_config(tmp_path / "a", 6))
  uninterrupted_rngs = TypedKeys.seen_rngs
  run_keys(disk_config(tmp_path / "b", 3))
  resumed = run_keys(disk_config(tmp_path / "b", 6))
  assert len(TypedKeys.seen_rngs) == 3
  for got, want in zip(TypedKeys.seen_rngs, uninterrupted_rngs[3:], strict=True):
    np.testing.assert_array_equal(got, want)
  assert devices.is_typed_key(resumed.train_step_rng)
  module, reference = resumed.experiment_module, uninterrupted.experiment_module
  for got, want in ((module._key, reference._key), (module._device_keys, reference._device_keys),
                    (module._late_key, reference._late_key)):
    assert devices.is_typed_key(got) and got.shape == want.shape
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))


def test_a_series_directory_saves_cannot_write_is_refused_before_training(tmp_path):
  """A file where `checkpoints/latest` belongs failed the first save, an
  interval of training later."""
  os.makedirs(tmp_path / "checkpoints")
  (tmp_path / "checkpoints" / "latest").write_text("")
  with pytest.raises(disk_checkpointing.CheckpointWriteError,
                     match="checkpoints/latest is not a directory") as raised:
    disk_checkpointing.DiskCheckpointer(disk_config(tmp_path, 2), "train")
  assert isinstance(raised.value, errors.OneLineError)


def test_a_relative_checkpoint_dir_not_made_yet_is_writable(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # The check looked for its parent until "" (forever).
  disk_checkpointing.DiskCheckpointer(disk_config("not_made_yet", 2), "train")


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, caplog):
  run(disk_config(tmp_path, 6))
  newest = os.path.join(tmp_path, "checkpoints", "latest", "6")
  for dirpath, _, files in os.walk(os.path.join(newest, "state")):
    for name in files:
      with open(os.path.join(dirpath, name), "r+b") as f:
        f.truncate(3)
  resumed = run(disk_config(tmp_path, 8))
  assert Rich.seen_steps == [4, 5, 6, 7]
  assert resumed._history == list(range(8))
  assert "could not be loaded" in caplog.text and newest in caplog.text


def test_partial_save_is_ignored_and_cleaned(tmp_path):
  run(disk_config(tmp_path, 4))
  partial = os.path.join(tmp_path, "checkpoints", "latest", "6.orbax-checkpoint-tmp-123")
  shutil.copytree(os.path.join(tmp_path, "checkpoints", "latest", "4"), partial)
  run(disk_config(tmp_path, 5))
  assert Rich.seen_steps == [4]
  assert not os.path.exists(partial)


@pytest.mark.parametrize("restore_path", [
    "source/checkpoints/latest", "source/checkpoints/latest/4",
    "source"])  # The other run's checkpoint_dir.
def test_restore_path_starts_a_fresh_run_where_the_checkpoint_is(tmp_path, restore_path):
  run(disk_config(tmp_path / "source", 4))
  fresh = run(disk_config(tmp_path / "fresh", 6, restore_path=str(tmp_path / restore_path)))
  assert Rich.seen_steps == [4, 5]
  assert fresh._history == [0, 1, 2, 3, 4, 5]
  assert series_steps(tmp_path / "fresh") == [6]
  assert series_steps(tmp_path / "source") == [2, 4]  # Another run's: untouched.


def test_a_run_started_from_restore_path_continues_the_other_run_exactly(tmp_path):
  """Step, key chain and optimizer state together: an optimizer's own count
  (which its schedules read) stays the run's step."""
  whole = run(disk_config(tmp_path / "whole", 6))
  run(disk_config(tmp_path / "source", 4))
  fresh = run(disk_config(tmp_path / "fresh", 6, restore_path=str(tmp_path / "source")))
  chex.assert_trees_all_equal(jax.device_get(fresh._params), jax.device_get(whole._params))
  chex.assert_trees_all_equal(jax.device_get(fresh._opt_state), jax.device_get(whole._opt_state))
  assert int(utils.get_first(fresh._opt_state[0].count)) == 6


def test_an_eval_job_beside_a_run_started_from_restore_path_follows_that_run(tmp_path):
  """Not the other run's end: the source finished at its step 4, this run goes on to 8."""
  run(disk_config(tmp_path / "source", 4))
  config = disk_config(tmp_path / "side", 8, restore_path=str(tmp_path / "source"))
  evaluated, done = [], threading.Event()

  class Recording(Rich):
    def evaluate(self, global_step, **unused):
      evaluated.append(int(utils.get_first(global_step)))
      return super().evaluate()

  def evaluate():
    try:
      train.evaluate(Recording, config, disk_checkpointing.DiskCheckpointer(config, "eval"), None,
                     jaxline_mode="eval", poll_interval_secs=0.01)
    finally:
      done.set()

  threading.Thread(target=evaluate, daemon=True).start()
  deadline = time.monotonic() + 60
  while not evaluated and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.5)  # Many polls with no training run: the job must still wait for this one.
  assert not done.is_set(), evaluated
  run(config)
  assert done.wait(60)
  assert evaluated[0] == 4 and evaluated[-1] == 8, evaluated


def test_a_restore_path_at_or_past_training_steps_is_refused_naming_the_key(tmp_path):
  run(disk_config(tmp_path / "source", 4))
  with pytest.raises(base_config.ConfigError, match=r"^config.restore_path: .* at step 4, "
                     r"where its training ends \(training_steps=2\).*set training_steps above 4$"):
    run(disk_config(tmp_path / "fresh", 2, restore_path=str(tmp_path / "source")))
  assert Rich.seen_steps == []


def test_a_resumed_run_says_it_does_not_read_its_restore_path(tmp_path, caplog):
  run(disk_config(tmp_path, 2))
  caplog.set_level("WARNING")
  run(disk_config(tmp_path, 4, restore_path=str(tmp_path / "mistyped")))
  assert Rich.seen_steps == [2, 3]
  assert (f"config.restore_path='{tmp_path / 'mistyped'}' is not read: the run resumes its own "
          f"checkpoint {tmp_path / 'checkpoints' / 'latest' / '2'}.") in caplog.text


def test_a_restore_path_whose_newest_checkpoint_is_damaged_seeds_from_the_one_before(tmp_path,
                                                                                    caplog):
  run(disk_config(tmp_path / "source", 4))
  source = tmp_path / "source" / "checkpoints" / "latest"
  _truncate(source / "4")
  fresh = run(disk_config(tmp_path / "fresh", 4, restore_path=str(tmp_path / "source")))
  assert fresh._history == [0, 1, 2, 3]  # From step 2, its own steps 2 and 3.
  assert f"Checkpoint {source / '4'} could not be loaded" in caplog.text
  assert series_steps(tmp_path / "source") == [2, 4]  # Another run's: nothing moved.


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_an_unusable_restore_path_is_refused_naming_the_config_key(tmp_path, where, caplog):
  os.makedirs(tmp_path / "empty")
  restore_path = str(tmp_path / where)
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=f"^config.restore_path='{restore_path}': ") as raised:
    run(disk_config(tmp_path / "fresh", 2, restore_path=restore_path))
  if where == "empty":  # Not orbax's "Item meta was not found. Available items: []".
    assert str(raised.value).endswith("it is not a checkpoint: it has no meta/ item")
  else:  # A mistyped path is not "not a checkpoint".
    assert str(raised.value).endswith(f"{restore_path}': it does not exist")
  assert "trying the previous one" not in caplog.text  # There is none.


def test_best_series_on_disk_keeps_metric_value(tmp_path):
  config = disk_config(tmp_path, 4, best_model_eval_metric="b0",
                       best_model_eval_metric_higher_is_better=False)
  run(config)
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "eval")
  train.evaluate(Rich, config, checkpointer, None, jaxline_mode="eval")
  assert series_steps(tmp_path, "best") == [4]
  best = disk_checkpointing.DiskCheckpointer(config, "eval")
  state = best.get_experiment_state("best")
  best.restore("best")
  assert state.global_step == 4 and state.best_eval_metric_value < 0


def test_an_earlier_runs_best_past_the_first_evaluation_is_set_aside(tmp_path, caplog):
  """A run restarted afresh (its `latest` removed) beside the best series of the run
  before: this run's bests must neither have to beat it nor land in its series."""
  config = disk_config(tmp_path, 4, best_model_eval_metric="b0")
  run(config)
  train.evaluate(Rich, config, disk_checkpointing.DiskCheckpointer(config, "eval"), None,
                 jaxline_mode="eval")
  shutil.rmtree(tmp_path / "checkpoints" / "latest")
  config = disk_config(tmp_path, 2, best_model_eval_metric="b0")
  run(config)
  caplog.set_level("WARNING")
  train.evaluate(Rich, config, disk_checkpointing.DiskCheckpointer(config, "eval"), None,
                 jaxline_mode="eval")
  assert series_steps(tmp_path, "best") == [2]
  [aside] = [name for name in os.listdir(tmp_path / "checkpoints") if ".earlier-" in name]
  assert aside.startswith("best.earlier-") and series_steps(tmp_path, aside) == [4]
  assert "(b0=" in caplog.text and "at step 4) is past step 2, evaluated first: an earlier " \
      "run's, set aside" in caplog.text
  assert f"Moved {tmp_path / 'checkpoints' / 'best'} to {tmp_path / 'checkpoints' / aside}" \
      in caplog.text


def test_a_series_every_process_writes_is_set_aside_by_the_chief(tmp_path):
  """Mesh mode: kept, a new best at a lower step could not be saved in it."""
  config = disk_config(tmp_path, 2, best_model_eval_metric="b0")
  run(config)
  train.evaluate(Rich, config, disk_checkpointing.DiskCheckpointer(config, "eval"), None,
                 jaxline_mode="eval")
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "eval")
  checkpointer.every_process_saves = True
  checkpointer.set_aside("best")
  assert [name.split("-")[0] for name in os.listdir(tmp_path / "checkpoints")
          if name.startswith("best")] == ["best.earlier"]


def test_a_process_writing_its_own_tree_sets_its_own_series_aside(tmp_path, monkeypatch):
  """`best_checkpoint_all_hosts` in pmap mode: each process saves a tree of its own."""
  monkeypatch.setattr(multihost, "is_chief", lambda: False)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  checkpointer = disk_checkpointing.DiskCheckpointer(disk_config(tmp_path, 2), "eval")
  own = tmp_path / "checkpoints" / "process_1"
  os.makedirs(own / "best" / "6")
  checkpointer.set_aside("best")
  assert [name.split("-")[0] for name in os.listdir(own)] == ["best.earlier"]


class NotesOnNewBest(Rich):
  """jaxline's `on_new_best_model` may add to the best state ("to dump
  additional information from the evaluator")."""

  def on_new_best_model(self, best_state):
    best_state.note = "exported"


def test_an_evaluator_restarts_over_a_best_state_its_on_new_best_model_added_to(tmp_path):
  config = disk_config(tmp_path, 4, best_model_eval_metric="b0",
                       best_model_eval_metric_higher_is_better=False)
  run(config)
  train.evaluate(NotesOnNewBest, config, disk_checkpointing.DiskCheckpointer(config, "eval"),
                 None, jaxline_mode="eval")
  restarted = disk_checkpointing.DiskCheckpointer(config, "eval")
  state = restarted.get_experiment_state("best")
  state.global_step, state.best_eval_metric_value = 0, float("inf")
  restarted.restore("best")
  assert state.global_step == 4 and state.best_eval_metric_value < 0
  assert "note" not in state  # As jaxline: the live state's entries are restored.


def test_evaluators_of_different_modes_keep_best_series_of_their_own(tmp_path):
  config = disk_config(tmp_path, 4, best_model_eval_metric="b0")
  run(config)
  for mode in ("eval", "eval_heldout"):
    train.evaluate(Rich, config, disk_checkpointing.DiskCheckpointer(config, mode), None,
                   jaxline_mode=mode)
  assert series_steps(tmp_path, "best") == series_steps(tmp_path, "best_heldout") == [4]
  heldout = disk_checkpointing.DiskCheckpointer(config, "eval_heldout")
  assert heldout.restore_path("best").endswith(os.path.join("best_heldout", "4"))


def test_a_restarted_evaluator_writes_each_step_once(tmp_path):
  config = disk_config(tmp_path, 4)
  run(config)
  path = tmp_path / "eval" / "metrics.jsonl"
  for _ in range(2):  # The second evaluator redoes the newest checkpoint.
    writer = writers.JsonlWriter(str(path))
    train.evaluate(Rich, config, disk_checkpointing.DiskCheckpointer(config, "eval"), writer,
                   jaxline_mode="eval")
    writer.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [4]


def test_an_eval_job_goes_past_a_checkpoint_rotated_out_while_it_reads(tmp_path, monkeypatch,
                                                                       caplog):
  # The trainer's max_checkpoints_to_keep deleted the checkpoint (and the older
  # ones) the eval job was reading: it stopped with "no usable checkpoint".
  config = disk_config(tmp_path, 8, max_checkpoints_to_keep=4)
  run(config)  # Steps 2, 4, 6, 8.
  series = tmp_path / "checkpoints" / "latest"
  os.rename(series / "8", tmp_path / "8")  # Not saved yet when the eval job starts.
  real_load = checkpoint_restore.load

  def load_while_training_saves(path, *args, **kwargs):
    if (tmp_path / "8").exists():  # The save lands and rotates the older ones out.
      os.rename(tmp_path / "8", series / "8")
      for step in (2, 4, 6):
        shutil.rmtree(series / str(step))
    return real_load(path, *args, **kwargs)

  monkeypatch.setattr(checkpoint_restore, "load", load_while_training_saves)
  path = tmp_path / "eval" / "metrics.jsonl"
  writer = writers.JsonlWriter(str(path))
  train.evaluate(Rich, config, disk_checkpointing.DiskCheckpointer(config, "eval"), writer,
                 jaxline_mode="eval", poll_interval_secs=0.01)
  writer.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [8]
  assert f"Not evaluated: {series / '6'} did not load" in caplog.text


def test_read_without_an_experiment(tmp_path):
  run(disk_config(tmp_path, 4))
  step, nest = disk_checkpointing.read(str(tmp_path))
  assert step == 4 and nest["global_step"] == 4
  module = nest["experiment_module"]
  assert module["history"] == [0, 1, 2, 3]
  assert set(module["params"]) == {"w", "b"}  # plain dicts keep their keys
  assert isinstance(module["moments"], list) and len(module["moments"]) == 2  # NamedTuple leaves
  older, _ = disk_checkpointing.read(str(tmp_path), step=2)
  assert older == 2
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    disk_checkpointing.read(str(tmp_path), series="best")


def test_checkpoint_reads_with_orbax_alone_by_name(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  trained = run(disk_config(tmp_path, 4))
  tree = ocp.StandardCheckpointer().restore(
      os.path.join(tmp_path, "checkpoints", "latest", "4", "state"))
  module = tree["experiment_module"]
  params = utils.get_first(trained._params)
  np.testing.assert_array_equal(module["params"]["w"], params["w"])  # one copy: no device axis
  assert module["params"]["w"].shape == (2, 3)
  adam = utils.get_first(trained._opt_state)[0]
  np.testing.assert_array_equal(module["opt_state"]["0"]["mu"]["b"], adam.mu["b"])
  assert int(module["moments"]["count"]) == 4  # a NamedTuple's fields by name
  assert tree["train_step_rng"].shape == (jax.local_device_count(), 2)
  assert "history" not in module  # plain Python values live in the JSON item

  # Where a user reads weights: a notebook with one device, not the run's four.
  read = subprocess.run(
      [sys.executable, "-c", "import sys, orbax.checkpoint as ocp\n"
       "tree = ocp.StandardCheckpointer().restore(sys.argv[1])\n"
       "print(tree['experiment_module']['params']['w'].tolist())",
       os.path.join(tmp_path, "checkpoints", "latest", "4", "state")],
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=120, check=False)
  assert read.returncode == 0, read.stderr[-2000:]
  assert read.stdout.strip().splitlines()[-1] == str(params["w"].tolist())


def _data_files(step_dir):
  return [os.path.join(dirpath, name)
          for dirpath, _, names in os.walk(os.path.join(step_dir, "state"))
          if os.path.basename(dirpath) == "d" for name in names]


def _random_bytes_into_data_files(step_dir):
  # Orbax keeps small arrays inline in its index files and larger ones in
  # per-process data files: 4 KiB land in each, so the arrays' own bytes are hit.
  for path in _data_files(step_dir):
    with open(path, "r+b") as f:
      f.seek(max(0, os.path.getsize(path) - 4096) // 2)
      f.write(np.random.default_rng(0).bytes(4096))


def _truncate(step_dir):
  for path in _data_files(step_dir):
    with open(path, "r+b") as f:
      f.truncate(3)


def _empty(step_dir):
  for dirpath, _, names in os.walk(step_dir):
    for name in names:
      open(os.path.join(dirpath, name), "w").close()


def _edit_meta(step_dir, edit):
  import json  # pylint: disable=import-outside-toplevel
  path = os.path.join(step_dir, "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  edit(meta)
  with open(path, "w") as f:
    json.dump(meta, f)


def _bad_value(step_dir):
  def edit(meta):
    meta["entries"]["experiment_module/history"]["leaves"][0]["value"] = 99
  _edit_meta(step_dir, edit)


def _unexpected_entry(step_dir):
  def edit(meta):
    meta["entries"]["experiment_module/extra"] = {"leaves": [{"value": 1}],
                                                  "skeleton": {"leaf": 0}}
  _edit_meta(step_dir, edit)


def _array_unlike_its_checksum(step_dir):
  """Data that still decodes but holds other values: only the checksum tells."""
  def edit(meta):
    meta["arrays"]["experiment_module/params/w"]["fingerprint"][0] ^= 1
    meta["digest"] = checkpoint_format.digest(meta)
  _edit_meta(step_dir, edit)


@pytest.mark.parametrize("damage", [_random_bytes_into_data_files, _truncate, _empty,
                                    _bad_value, _unexpected_entry, _array_unlike_its_checksum])
def test_damaged_newest_checkpoint_is_moved_aside_and_saving_continues(tmp_path, caplog, damage):
  run(disk_config(tmp_path, 6))
  series = os.path.join(tmp_path, "checkpoints", "latest")
  newest = os.path.join(series, "6")
  damage(newest)
  resumed = run(disk_config(tmp_path, 8))
  assert Rich.seen_steps == [4, 5, 6, 7]  # resumed from the previous checkpoint
  assert resumed._history == list(range(8))
  assert series_steps(tmp_path) == [4, 6, 8]  # saving went on past the damaged step
  moved = os.listdir(disk_checkpointing.unusable_dir(series))
  assert len(moved) == 1 and moved[0].startswith("6-")
  assert "could not be loaded" in caplog.text
  ours = [r.getMessage() for r in caplog.records if "could not be loaded" in r.getMessage()]
  # One line each: not TensorStore's 1 kB spec, which orbax's messages go on to print.
  assert ours and not any("tensorstore_spec" in m or "\n" in m for m in ours), ours
  assert os.path.join(disk_checkpointing.unusable_dir(series), moved[0]) in caplog.text
  # The checkpoint saved at step 6 after the move restores and matches the run.
  step, nest = disk_checkpointing.read(str(tmp_path), step=6)
  assert step == 6 and nest["experiment_module"]["history"] == list(range(6))


def test_a_renamed_step_directory_is_moved_aside_not_resumed_at_its_name(tmp_path, caplog):
  run(disk_config(tmp_path, 6))
  series = os.path.join(tmp_path, "checkpoints", "latest")
  os.rename(os.path.join(series, "6"), os.path.join(series, "9"))
  run(disk_config(tmp_path, 8))
  assert Rich.seen_steps == [4, 5, 6, 7]
  assert series_steps(tmp_path) == [4, 6, 8]
  assert "it holds step 6, but its directory is named 9" in caplog.text
  assert os.listdir(disk_checkpointing.unusable_dir(series))[0].startswith("9-")


def test_no_usable_checkpoint_is_refused_and_nothing_is_moved(tmp_path):
  run(disk_config(tmp_path, 4))
  series = os.path.join(tmp_path, "checkpoints", "latest")
  for step in series_steps(tmp_path):
    _truncate(os.path.join(series, str(step)))
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"no usable checkpoint for series 'latest': .*latest/4: its arrays"):
    run(disk_config(tmp_path, 6))
  assert series_steps(tmp_path) == [2, 4]
  assert not os.path.exists(disk_checkpointing.unusable_dir(series))


def test_checkpoint_of_another_experiment_shape_is_refused_naming_it(tmp_path, trained_to_2):

  class Wider(Rich):

    def __init__(self, mode, init_rng):
      super().__init__(mode, init_rng)
      self._params = utils.bcast_local_devices({"w": jnp.zeros((2, 5)), "b": jnp.zeros(3)})

  config = disk_config(tmp_path, 4)
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"params/w has shape \(2, 3\) but the experiment's __init__ makes "
                           r"it \(2, 5\)") as e:
    train.train(Wider, config, disk_checkpointing.DiskCheckpointer(config, "train"), None)
  assert str(e.value).count("params") == 1, e.value  # The entry is named once.


class HalfPrecision(Rich):
  """Rich with its weights made bfloat16."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    params = {"w": jnp.zeros((2, 3), jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
    self._params = utils.bcast_local_devices(params)
    self._opt_state = utils.bcast_local_devices(self._opt.init(params))


def test_arrays_resumed_in_another_dtype_than_init_makes_are_named(tmp_path, caplog):
  # Restored as saved (a dtype may drift as state trains), but a model changed
  # to bfloat16 went on in float32 without a word.
  run(disk_config(tmp_path, 2))
  config = disk_config(tmp_path, 2)
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  train.train(HalfPrecision, config, checkpointer, None)
  assert re.search(r"Restored 6 arrays in the dtype they were saved in: experiment_module/\S+ "
                   r"float32 \(__init__ makes bfloat16\);", caplog.text), caplog.text
  restored = checkpointer.get_experiment_state("latest").experiment_module
  assert utils.get_first(restored._params)["w"].dtype == jnp.float32  # pylint: disable=protected-access


class Wider(Rich):
  """Rich with a wider layer, trainable."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    params = {"w": jnp.zeros((2, 5)), "b": jnp.zeros(3)}
    self._params = utils.bcast_local_devices(params)
    self._opt_state = utils.bcast_local_devices(self._opt.init(params))


def test_a_newest_checkpoint_that_does_not_fit_is_refused_not_rolled_back_from(tmp_path):
  """An older checkpoint that fits (state that grew, a model changed back and
  forth) must not be resumed silently in place of the newest one."""
  run(disk_config(tmp_path / "run", 2))
  config = disk_config(tmp_path / "wider", 4)
  train.train(Wider, config, disk_checkpointing.DiskCheckpointer(config, "train"), None)
  series = os.path.join(tmp_path, "run", "checkpoints", "latest")
  shutil.copytree(os.path.join(tmp_path, "wider", "checkpoints", "latest", "4"),
                  os.path.join(series, "4"))
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"checkpoint .*latest/4 does not fit the experiment: .*mu/w has "
                           r"shape \(2, 5\) but the experiment's __init__ makes it \(2, 3\)"
                           r".*if its code"):
    run(disk_config(tmp_path / "run", 6))
  assert Rich.seen_steps == []
  assert series_steps(tmp_path / "run") == [2, 4]  # Nothing moved aside.
  assert not os.path.exists(disk_checkpointing.unusable_dir(series))


class LayerAdded(Rich):

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._params = utils.bcast_local_devices(
        {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3), "b2": jnp.zeros(3)})


def test_a_checkpoint_lacking_arrays_the_experiment_has_is_refused_naming_them(tmp_path,
                                                                               trained_to_2):
  """Before, the saved dict replaced the live one and the step failed on the missing key."""
  config = disk_config(tmp_path, 4)
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match="entry experiment_module/params lacks experiment_module/params/b2"):
    train.train(LayerAdded, config, disk_checkpointing.DiskCheckpointer(config, "train"), None)


class WithMomentum(Rich):
  OPTIMIZER = optax.sgd(0.1, momentum=0.9)

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._opt = self.OPTIMIZER
    self._opt_state = utils.bcast_local_devices(
        self._opt.init({"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}))


class WithPlainSgd(WithMomentum):
  OPTIMIZER = optax.sgd(0.1)


def test_a_checkpoint_holding_entries_the_experiment_no_longer_has_is_refused_naming_them(
    tmp_path):
  """Before, the momentum buffers were put into plain SGD's state and saved on with it."""
  train_to(WithMomentum, tmp_path, 2)
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"entry experiment_module/opt_state holds experiment_module/opt_state/"
                           r"0/trace/b, experiment_module/opt_state/0/trace/w, which the "
                           r"experiment's does not have \(config.drop_extra_checkpoint_entries="
                           r"True resumes without them\)"):
    train_to(WithPlainSgd, tmp_path, 4)
  config = disk_config(tmp_path, 4, drop_extra_checkpoint_entries=True)
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  train.train(WithPlainSgd, config, checkpointer, None)
  assert Rich.seen_steps[-2:] == [2, 3]  # Resumed, without them, and saved without them.
  resumed = checkpointer.get_experiment_state("latest").experiment_module
  assert jax.tree.structure(resumed._opt_state) == jax.tree.structure(  # pylint: disable=protected-access
      utils.bcast_local_devices(WithPlainSgd.OPTIMIZER.init({"w": jnp.zeros(1)})))
  step, saved = disk_checkpointing.read(str(tmp_path))
  assert step == 4 and not jax.tree.leaves(saved["experiment_module"]["opt_state"])


class DriftsToFloat32(Rich):
  """bfloat16 weights that training makes float32 (a float32 scale), as code may by accident."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), self._params)
    self._scale = jax.pmap(lambda params: jax.tree.map(lambda x: x * jnp.float32(1), params))

  def step(self, global_step, **unused):
    self._params = self._scale(self._params)
    return super().step(global_step=global_step)


def test_model_state_whose_dtype_drifts_in_training_resumes_as_saved(tmp_path):
  """Before, the same code could not resume: the float32 weights were refused for
  `__init__`'s bfloat16."""
  Rich.seen_steps = []
  train_to(DriftsToFloat32, tmp_path, 2)
  resumed = train_to(DriftsToFloat32, tmp_path, 4)
  assert Rich.seen_steps == [0, 1, 2, 3]  # Resumed at 2.
  assert utils.get_first(resumed._params)["w"].dtype == jnp.float32  # pylint: disable=protected-access


class NumPyScale(Rich):
  """Model state `__init__` makes in NumPy's float64, which JAX's step makes float32."""
  CHECKPOINT_ATTRS = {**Rich.CHECKPOINT_ATTRS, "_scale": "scale"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._scale = np.ones((jax.local_device_count(),))
    self._double = jax.pmap(lambda scale: scale * 2)

  def step(self, global_step, **unused):
    self._scale = self._double(self._scale)
    return super().step(global_step=global_step)


def test_numpy_64_bit_model_state_resumes_as_jax_made_it(tmp_path):
  """Before, the same code could not resume: float32 was taken for another dtype."""
  train_to(NumPyScale, tmp_path, 2)
  np.testing.assert_array_equal(np.asarray(train_to(NumPyScale, tmp_path, 4)._scale), 16.0)  # pylint: disable=protected-access


def test_processes_refusing_together_name_the_one_that_found_the_difference(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  monkeypatch.setattr(multihost, "all_reduce_sum", lambda found: found + [[0, 0, 0], [0, 0, 1]])
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"the state of process 2 does not fit it \(its log names"):
    checkpoint_restore.raise_agreed(None, agree=True)


@pytest.mark.parametrize("option, value, message", [
    # Before, a 64-bit array read back as 32 bits failed its checksum: the intact checkpoint
    # was moved aside as damaged and the run rolled back to an older one.
    ("jax_enable_x64", True, "saved with jax_enable_x64=False, and this run has True"),
    # Before, the first step failed in a traceback turning 2-word keys into rbg's 4-word ones.
    ("jax_default_prng_impl", "rbg", "train_step_rng holds keys of 2 words where this run's "
                                     "hold 4"),
])
def test_a_checkpoint_of_another_jax_setting_is_refused(tmp_path, trained_to_2, option, value,
                                                        message):
  saved_value = getattr(jax.config, option)
  jax.config.update(option, value)
  try:
    with pytest.raises(disk_checkpointing.CheckpointRefused, match=message):
      run(disk_config(tmp_path, 4))
  finally:
    jax.config.update(option, saved_value)
  assert Rich.seen_steps == [] and series_steps(tmp_path) == [2]


class PerDevice(Rich):
  """A NON_BROADCAST pmap output: one row per device, over DEVICES devices."""
  NON_BROADCAST_CHECKPOINT_ATTRS = {**Rich.NON_BROADCAST_CHECKPOINT_ATTRS, "_rows": "rows"}
  DEVICES = 4

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._rows = jax.pmap(lambda x: x, devices=jax.local_devices()[:self.DEVICES])(
        jnp.arange(self.DEVICES, dtype=jnp.float32))


class PerTwoDevices(PerDevice):
  DEVICES = 2


class PerOneDevice(PerDevice):
  DEVICES = 1


@pytest.mark.parametrize("fewer", [PerTwoDevices, PerOneDevice])
def test_a_per_device_value_saved_on_more_devices_is_refused(tmp_path, fewer):
  """Its rows are the devices': it cannot take the saved shape as a buffer that grows does,
  even on one device (before, it did there, and the first step failed in a traceback)."""
  config = disk_config(tmp_path, 2)
  train.train(PerDevice, config, disk_checkpointing.DiskCheckpointer(config, "train"), None)
  config = disk_config(tmp_path, 4)
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"experiment_module/rows has shape \(4,\) but the experiment's "
                           rf"__init__ makes it \({fewer.DEVICES},\)"):
    train.train(fewer, config, disk_checkpointing.DiskCheckpointer(config, "train"), None)


class CountsPerDevice(Rich):
  """Per-device values `__init__` makes on one device; a pmapped step would spread them."""
  NON_BROADCAST_CHECKPOINT_ATTRS = {**Rich.NON_BROADCAST_CHECKPOINT_ATTRS, "_counts": "counts"}
  DEVICES = None  # jax.local_device_count()

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._counts = jnp.zeros((self.DEVICES or jax.local_device_count(),))


class CountsPerTwoDevices(CountsPerDevice):
  DEVICES = 2


def test_a_per_device_value_made_on_one_device_is_refused_on_fewer_devices(tmp_path,
                                                                             monkeypatch):
  """Before, the saved run's 4 rows were restored on 2 devices, and the step failed in a
  traceback (a user trying topologies)."""
  train_to(CountsPerDevice, tmp_path, 2)
  topology = checkpoint_format.current_topology()
  monkeypatch.setattr(checkpoint_format, "current_topology",  # A resume on 2 devices.
                      lambda: dict(topology, local_device_count=2))
  config = disk_config(tmp_path, 4)
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"experiment_module/counts has shape \(4,\) but the experiment's "
                           r"__init__ makes it \(2,\)"):
    train.train(CountsPerTwoDevices, config,
                disk_checkpointing.DiskCheckpointer(config, "train"), None)


class ReducedPerDevice(PerDevice):
  """A per-device value that the first step reduces to one number."""

  def step(self, global_step, **unused):
    self._rows = jnp.sum(self._rows)
    return super().step(global_step=global_step)


def test_a_per_device_value_reduced_in_training_resumes_as_saved(tmp_path):
  """Before, the same code could not resume: its device axis was gone since `__init__`."""
  Rich.seen_steps = []
  train_to(ReducedPerDevice, tmp_path, 2)
  assert float(train_to(ReducedPerDevice, tmp_path, 4)._rows) == 6  # pylint: disable=protected-access
  assert Rich.seen_steps == [0, 1, 2, 3]  # Resumed at 2.


class GrowingPerDeviceBuffer(Rich):
  """A NON_BROADCAST pmap output that grows each step: a row of history per device."""
  NON_BROADCAST_CHECKPOINT_ATTRS = {**Rich.NON_BROADCAST_CHECKPOINT_ATTRS, "_seen": "seen"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._seen = jax.pmap(lambda x: x)(jnp.zeros((jax.local_device_count(), 0)))
    self._append = jax.pmap(lambda seen, step: jnp.append(seen, step.astype(seen.dtype)))

  def step(self, global_step, **unused):
    self._seen = self._append(self._seen, jnp.asarray(global_step))
    return super().step(global_step=global_step)


def test_a_per_device_buffer_that_grows_resumes_with_its_saved_shape(tmp_path):
  """Before, the same code could not resume: its rows had grown since `__init__`."""
  train_to(GrowingPerDeviceBuffer, tmp_path, 4)
  seen = train_to(GrowingPerDeviceBuffer, tmp_path, 6)._seen  # pylint: disable=protected-access
  assert isinstance(seen, jax.Array) and len(seen.sharding.device_set) == jax.local_device_count()
  np.testing.assert_array_equal(np.asarray(seen), np.tile(np.arange(6), (seen.shape[0], 1)))


class GrowingBuffer(Rich):
  """A NON_BROADCAST buffer that grows each step (a replay buffer), in NumPy."""
  NON_BROADCAST_CHECKPOINT_ATTRS = {**Rich.NON_BROADCAST_CHECKPOINT_ATTRS, "_seen": "seen"}
  xp = np

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._seen = self.xp.zeros((0,), np.float32)

  def step(self, global_step, **unused):
    step = np.float32(utils.get_first(global_step))
    self._seen = self.xp.append(self._seen, step)
    return super().step(global_step=global_step)


class GrowingDeviceBuffer(GrowingBuffer):
  xp = jnp


@pytest.mark.parametrize("buffer_class, array_type", [(GrowingBuffer, np.ndarray),
                                                      (GrowingDeviceBuffer, jax.Array)])
def test_a_buffer_that_grows_resumes_with_its_saved_shape_and_type(tmp_path, buffer_class,
                                                                   array_type):
  train_to(buffer_class, tmp_path, 4)
  np.testing.assert_array_equal(train_to(buffer_class, tmp_path, 6)._seen, np.arange(6))  # pylint: disable=protected-access
  assert Rich.seen_steps[-2:] == [4, 5]
  # Restores, runs no step.
  seen = train_to(buffer_class, tmp_path, 6)._seen  # pylint: disable=protected-access
  assert isinstance(seen, array_type), type(seen)  # As saved: `.at[]` works on a device one.


def test_format_1_checkpoint_is_refused_naming_the_format(tmp_path):
  old = os.path.join(tmp_path, "checkpoints", "latest", "4")
  os.makedirs(os.path.join(old, "arrays"))
  os.makedirs(os.path.join(old, "meta"))
  with pytest.raises(disk_checkpointing.CheckpointRefused, match="format 1"):
    run(disk_config(tmp_path, 6))
  assert os.path.isdir(old)


class EvalWithoutOptimizer(Rich):
  """Published pattern: the eval modes build no optimizer state (None)."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    if mode != "train":
      self._opt_state = None


def test_an_eval_mode_that_holds_none_restores_it_as_jaxline_does(tmp_path):
  config = disk_config(tmp_path, 4)
  trained = run(config)
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "eval")
  writer = []

  class Rows:
    def write_scalars(self, step, scalars):
      writer.append((step, scalars["b0"]))

    def write_images(self, step, images):
      pass

  train.evaluate(EvalWithoutOptimizer, config, checkpointer, Rows(), jaxline_mode="eval")
  assert [step for step, _ in writer] == [4]
  assert writer[0][1] != 0.0  # Trained parameters were restored.
  restored = checkpointer.get_experiment_state("latest").experiment_module
  assert isinstance(utils.get_first(restored._opt_state)[0], optax.ScaleByAdamState)  # pylint: disable=protected-access
  _assert_same_arrays(restored._opt_state, trained._opt_state)  # pylint: disable=protected-access


class EvalListsFewerAttributes(Rich):
  """kfac-jax's pattern: CHECKPOINT_ATTRS, a property, leaves the optimizer out in eval."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self.mode = mode  # As kfac-jax's: jaxline's base class keeps nothing.

  @property
  def CHECKPOINT_ATTRS(self):  # pylint: disable=invalid-name  (jaxline's name)
    attrs = dict(Rich.CHECKPOINT_ATTRS)
    if self.mode != "train":
      del attrs["_opt_state"]
    return attrs


def test_an_eval_mode_that_checkpoints_fewer_attributes_restores_those(tmp_path):
  config = disk_config(tmp_path, 4)
  trained = run(config)
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "eval")
  train.evaluate(EvalListsFewerAttributes, config, checkpointer, None, jaxline_mode="eval")
  restored = checkpointer.get_experiment_state("latest").experiment_module
  assert checkpointer.get_experiment_state("latest").global_step == 4
  _assert_same_arrays(restored._params, trained._params)  # pylint: disable=protected-access


class TrainsFewerAttributes(Rich):
  CHECKPOINT_ATTRS = {"_params": "params", "_opt_state": "opt_state"}


def test_training_refuses_a_checkpoint_holding_attributes_it_does_not_checkpoint(tmp_path):
  run(disk_config(tmp_path, 4))
  config = disk_config(tmp_path, 6)
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match="moments, which the experiment does not checkpoint"):
    train.train(TrainsFewerAttributes, config,
                disk_checkpointing.DiskCheckpointer(config, "train"), None)


def _assert_same_arrays(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(utils.get_first(got)), jax.tree.leaves(utils.get_first(want))):
    np.testing.assert_array_equal(a, b)


class BuiltInFirstStep(Rich):
  """Published pattern (BYOL, NFNets): the optimizer state and other NamedTuple
  state are None after __init__; the first step builds them unless a restore
  has set them already."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._fresh = (self._opt_state, self._moments)
    self._opt_state = self._moments = None

  def step(self, global_step, **unused):
    if self._moments is None:
      self._opt_state, self._moments = self._fresh
    return super().step(global_step=global_step)


def _train(experiment_class, config):
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  train.train(experiment_class, config, checkpointer, None)
  return checkpointer.get_experiment_state("latest").experiment_module


def _uninterrupted_and_resumed(experiment_class, tmp_path, steps, stopped_at=4):
  """The experiments at the end of a run of `steps` and of one stopped and resumed."""
  uninterrupted = _train(experiment_class, disk_config(tmp_path / "once", steps))
  _train(experiment_class, disk_config(tmp_path / "twice", stopped_at))
  return uninterrupted, _train(experiment_class, disk_config(tmp_path / "twice", steps))


def test_state_built_in_the_first_step_resumes_instead_of_starting_afresh(tmp_path):
  uninterrupted, resumed = _uninterrupted_and_resumed(BuiltInFirstStep, tmp_path, 7)
  assert isinstance(utils.get_first(resumed._moments), Moments)  # pylint: disable=protected-access
  assert int(utils.get_first(resumed._moments).count) == 7  # pylint: disable=protected-access
  _assert_same_arrays((resumed._params, resumed._opt_state, resumed._moments),  # pylint: disable=protected-access
                      (uninterrupted._params, uninterrupted._opt_state, uninterrupted._moments))  # pylint: disable=protected-access


class AbsentUntilFirstStep(BuiltInFirstStep):
  """As BuiltInFirstStep, but the attributes do not exist until the first step
  (jaxline restores by setattr, so experiments written for it may do this)."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    del self._opt_state, self._moments

  def step(self, global_step, **unused):
    if not hasattr(self, "_moments"):
      self._opt_state = self._moments = None
    return super().step(global_step=global_step)


def test_state_absent_until_the_first_step_resumes_and_an_eval_job_restores_it(tmp_path):
  uninterrupted, resumed = _uninterrupted_and_resumed(AbsentUntilFirstStep, tmp_path, 7)
  assert int(utils.get_first(resumed._moments).count) == 7  # pylint: disable=protected-access
  _assert_same_arrays((resumed._params, resumed._moments),  # pylint: disable=protected-access
                      (uninterrupted._params, uninterrupted._moments))  # pylint: disable=protected-access
  evaluator = disk_checkpointing.DiskCheckpointer(disk_config(tmp_path / "once", 7), "eval")
  state = evaluator.get_experiment_state("latest")
  state.experiment_module = AbsentUntilFirstStep("eval", jax.random.PRNGKey(0))
  evaluator.restore("latest")
  assert int(utils.get_first(state.experiment_module._moments).count) == 7  # pylint: disable=protected-access


def test_training_refuses_state_it_cannot_rebuild_rather_than_start_it_afresh(tmp_path):
  # A NamedTuple class made inside a function: no module attribute names it.
  LocalMoments = collections.namedtuple("LocalMoments", ["mean", "count"])  # noqa: N806

  class BuiltFromLocalClass(BuiltInFirstStep):

    def __init__(self, mode, init_rng):
      super().__init__(mode, init_rng)
      self._fresh = (self._fresh[0], LocalMoments(*self._fresh[1]))

    def step(self, global_step, **unused):
      if self._moments is None:
        self._opt_state, self._moments = self._fresh
      moments = self._moments
      self._moments = Moments(*moments)
      scalars = Rich.step(self, global_step=global_step)
      self._moments = LocalMoments(*self._moments)
      return scalars

  _train(BuiltFromLocalClass, disk_config(tmp_path, 4))
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"experiment_module/moments cannot be restored: the experiment holds "
                           r"None there and its NamedTuple class \S+:LocalMoments is not "
                           r"imported"):
    _train(BuiltFromLocalClass, disk_config(tmp_path, 6))
  assert series_steps(tmp_path) == [2, 4]  # Nothing was moved aside or overwritten.


class State:
  """kfac-jax's way of making state a pytree: dataclasses flattened by field name."""

  def tree_flatten(self):
    names = tuple(field.name for field in dataclasses.fields(self))
    return tuple(getattr(self, name) for name in names), names

  @classmethod
  def tree_unflatten(cls, names, children):
    return cls(**dict(zip(names, children)))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class SecondMoment(State):
  raw_value: jax.Array
  weight: jax.Array


@chex.dataclass
class Statistics:
  """chex flattens a dataclass's fields in sorted order, not in the class's."""
  total: jax.Array
  count: jax.Array


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class OptimizerState(State):
  """The shape of kfac-jax's `Optimizer.State`: nested state, an optax state, a None."""
  velocities: optax.OptState
  estimator: SecondMoment
  damping: jax.Array | None
  step_counter: jax.Array
  statistics: Statistics


class KfacStyleStateBuiltInFirstStep(experiment.AbstractExperiment):
  """kfac-jax's examples build the optimizer state in the first step unless a
  restore has set it already."""
  CHECKPOINT_ATTRS = {"_opt_state": "opt_state"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._opt_state = None

    def update(state):
      return OptimizerState(
          velocities=jax.tree.map(lambda v: v + 0.5, state.velocities),
          estimator=SecondMoment(state.estimator.raw_value * 2.0 + 1.0,
                                 state.estimator.weight + 1.0),
          damping=None, step_counter=state.step_counter + 1,
          statistics=Statistics(total=state.statistics.total + 2.0,
                                count=state.statistics.count + 1))

    self._update = jax.pmap(update, axis_name="i")

  def step(self, **unused):
    if self._opt_state is None:
      self._opt_state = utils.bcast_local_devices(OptimizerState(
          velocities=optax.sgd(0.1, momentum=0.9).init({"w": jnp.zeros(3)}),
          estimator=SecondMoment(jnp.zeros((2, 2)), jnp.zeros(())), damping=None,
          step_counter=jnp.zeros((), jnp.int32),
          statistics=Statistics(total=jnp.zeros(2), count=jnp.zeros((), jnp.int32))))
    self._opt_state = self._update(self._opt_state)
    return {}

  def evaluate(self, **unused):
    return {}


def test_a_pytree_dataclass_built_in_the_first_step_resumes(tmp_path):
  uninterrupted, resumed = _uninterrupted_and_resumed(KfacStyleStateBuiltInFirstStep, tmp_path, 6)
  state = utils.get_first(resumed._opt_state)  # pylint: disable=protected-access
  assert type(state) is OptimizerState and type(state.estimator) is SecondMoment
  assert type(state.statistics) is Statistics
  assert state.damping is None and int(state.step_counter) == int(state.statistics.count) == 6
  _assert_same_arrays(resumed._opt_state, uninterrupted._opt_state)  # pylint: disable=protected-access


class HaikuFlatMapBuiltInFirstStep(experiment.AbstractExperiment):
  """deepmind-research's physics_inspired_models: params and optimizer state in
  haiku FlatMaps (`hk.data_structures.to_immutable_dict`), built in the first step."""
  CHECKPOINT_ATTRS = {"_params": "params", "_opt_state": "opt_state"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._params = self._opt_state = None
    self._opt = optax.adam(0.1)

    def update(params, opt_state):
      updates, opt_state = self._opt.update(jax.tree.map(jnp.ones_like, params), opt_state)
      return optax.apply_updates(params, updates), opt_state

    self._update = jax.pmap(update, axis_name="i")

  def step(self, **unused):
    if self._params is None:
      params = hk.data_structures.to_immutable_dict(
          {"mlp/~/linear_1": {"w": jnp.ones((3, 1)), "b": jnp.zeros(1)},
           "mlp/~/linear_0": {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}})
      self._params = utils.bcast_local_devices(params)
      self._opt_state = utils.bcast_local_devices(self._opt.init(params))
    self._params, self._opt_state = self._update(self._params, self._opt_state)
    return {}

  def evaluate(self, **unused):
    return {}


def test_haiku_flatmap_state_built_in_the_first_step_resumes_and_evaluates(tmp_path):
  uninterrupted, resumed = _uninterrupted_and_resumed(HaikuFlatMapBuiltInFirstStep, tmp_path, 6)
  assert type(utils.get_first(resumed._params)) is type(utils.get_first(uninterrupted._params))  # pylint: disable=protected-access
  assert not isinstance(utils.get_first(resumed._params), dict)  # pylint: disable=protected-access
  _assert_same_arrays((resumed._params, resumed._opt_state),  # pylint: disable=protected-access
                      (uninterrupted._params, uninterrupted._opt_state))  # pylint: disable=protected-access
  config = disk_config(tmp_path / "twice", 6)
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "eval")
  train.evaluate(HaikuFlatMapBuiltInFirstStep, config, checkpointer, None, jaxline_mode="eval")
  evaluated = checkpointer.get_experiment_state("latest").experiment_module
  _assert_same_arrays(evaluated._params, resumed._params)  # pylint: disable=protected-access


@functools.partial(jax.tree_util.register_dataclass, data_fields=["value"],
                   meta_fields=["name"])
@dataclasses.dataclass
class NamedValue:
  value: jax.Array
  name: str


class MetaFieldStateBuiltInFirstStep(experiment.AbstractExperiment):
  CHECKPOINT_ATTRS = {"_state": "state"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._state = None

  def step(self, **unused):
    if self._state is None:
      self._state = utils.bcast_local_devices(NamedValue(jnp.zeros(()), "counter"))
    return {}

  def evaluate(self, **unused):
    return {}


def test_training_refuses_a_dataclass_with_static_fields_it_cannot_rebuild(tmp_path):
  _train(MetaFieldStateBuiltInFirstStep, disk_config(tmp_path, 2))
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match="experiment_module/state cannot be restored: the experiment holds "
                           "None there and its type is not a dict, list, tuple, NamedTuple or "
                           "pytree dataclass"):
    _train(MetaFieldStateBuiltInFirstStep, disk_config(tmp_path, 4))


class Tables(experiment.AbstractExperiment):
  """Two tables of one shape in a dict, made in __init__; `names` may change between runs."""
  CHECKPOINT_ATTRS = {"_tables": "tables"}
  names = ("first", "second")

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._tables = utils.bcast_local_devices({name: jnp.zeros(3) for name in self.names})
    self._update = jax.pmap(lambda tables: {name: table + i + 1.0 for i, (name, table) in
                                            enumerate(sorted(tables.items()))}, axis_name="i")

  def step(self, **unused):
    self._tables = self._update(self._tables)
    return {}

  def evaluate(self, **unused):
    return {}


class RenamedTables(Tables):
  names = ("second", "third")  # `first` renamed: `second` now sorts where `first` did.


def test_a_renamed_key_is_refused_rather_than_handed_another_keys_arrays(tmp_path):
  _train(Tables, disk_config(tmp_path, 4))
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match="entry experiment_module/tables holds experiment_module/tables/first "
                           "where the experiment's has experiment_module/tables/third"):
    _train(RenamedTables, disk_config(tmp_path, 6))
  assert series_steps(tmp_path) == [2, 4]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pair:
  small: jax.Array
  large: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PairReordered:  # `Pair` after an edit that swapped its fields.
  large: jax.Array
  small: jax.Array


PairReordered.__qualname__ = PairReordered.__name__ = "Pair"


class PairState(experiment.AbstractExperiment):
  CHECKPOINT_ATTRS = {"_pair": "pair"}
  pair_class = Pair
  built_in_init = True  # Else in the first step, as kfac-jax builds its state.

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._pair = self._fresh() if self.built_in_init else None
    self._update = jax.pmap(lambda pair: self.pair_class(
        small=pair.small + 1.0, large=pair.large * 2.0 + 1.0), axis_name="i")

  def _fresh(self):
    return utils.bcast_local_devices(self.pair_class(small=jnp.zeros(2), large=jnp.zeros(2)))

  def step(self, **unused):
    if self._pair is None:
      self._pair = self._fresh()
    self._pair = self._update(self._pair)
    return {}

  def evaluate(self, **unused):
    return {}


@pytest.mark.parametrize("built_in_init", [True, False])
def test_dataclass_fields_reordered_since_the_save_resume_by_name(tmp_path, monkeypatch,
                                                                  built_in_init):
  monkeypatch.setattr(PairState, "built_in_init", built_in_init)
  _train(PairState, disk_config(tmp_path, 2))  # small 2, large 3
  monkeypatch.setattr(PairState, "pair_class", PairReordered)
  monkeypatch.setitem(globals(), "Pair", PairReordered)  # Where the checkpoint's name leads.
  pair = utils.get_first(_train(PairState, disk_config(tmp_path, 4))._pair)  # pylint: disable=protected-access
  assert type(pair) is PairReordered
  np.testing.assert_array_equal(pair.small, [4.0, 4.0])
  np.testing.assert_array_equal(pair.large, [15.0, 15.0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Checked:
  """A __post_init__ that rejects what a restore hands it (host arrays)."""
  value: jax.Array

  def __post_init__(self):
    if isinstance(self.value, np.ndarray):
      raise TypeError("value must not be a NumPy array")


class CheckedStateBuiltInFirstStep(experiment.AbstractExperiment):
  CHECKPOINT_ATTRS = {"_state": "state"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._state = None
    self._update = jax.pmap(lambda state: Checked(state.value + 1.0), axis_name="i")

  def step(self, **unused):
    if self._state is None:
      self._state = self._update(jax.pmap(lambda x: Checked(x))(jnp.zeros((4, 2))))
    self._state = self._update(self._state)
    return {}

  def evaluate(self, **unused):
    return {}


def test_a_dataclass_that_does_not_rebuild_is_refused_not_trained_afresh(tmp_path):
  config = disk_config(tmp_path, 4, save_initial_train_checkpoint=True)
  _train(CheckedStateBuiltInFirstStep, config)
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"entry experiment_module/state cannot be restored: the experiment "
                           r"holds None there and its dataclass \S+:Checked does not "
                           r"rebuild from its fields \(TypeError: value must not be a NumPy"):
    _train(CheckedStateBuiltInFirstStep, disk_config(tmp_path, 6))
  assert series_steps(tmp_path) == [0, 2, 4]  # None moved aside for the empty step 0.


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device"),
    # What TensorStore, orbax's array writer, raises on a full tmpfs.
    ValueError('RESOURCE_EXHAUSTED: Error writing "experiment_module.params/0" in OCDBT '
               'database at local file "/x/": Failed to write 113 bytes to file 9: No space '
               "left on device [os_error_code='28']"),
])
def test_a_full_disk_stops_training_with_one_line_naming_the_directory(tmp_path, trained_to_2,
                                                                      monkeypatch, error):

  def no_space(*args, **kwargs):
    raise error

  monkeypatch.setattr(disk_checkpointing._CheckpointManager, "save", no_space)  # pylint: disable=protected-access
  with pytest.raises(disk_checkpointing.CheckpointWriteError) as raised:
    run(disk_config(tmp_path, 6))
  series = os.path.join(tmp_path, "checkpoints", "latest")
  assert str(raised.value) == (f"[Errno 28] cannot save step 4 in {series}: "
                               "No space left on device")
  # The platform prints it as one line, exit 1.
  assert isinstance(raised.value, errors.OneLineError)
  assert series_steps(tmp_path) == [2]  # The checkpoint before it is intact.


class OrderedStatsBuiltInFirstStep(experiment.AbstractExperiment):
  """State in an OrderedDict, whose keys JAX flattens in insertion order, not sorted."""
  CHECKPOINT_ATTRS = {"_stats": "stats"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._stats = None
    self._update = jax.pmap(lambda stats: collections.OrderedDict(
        [("steps", stats["steps"] + 1.0), ("loss_sum", stats["loss_sum"] + 100.0)]),
                            axis_name="i")

  def step(self, **unused):
    if self._stats is None:
      self._stats = utils.bcast_local_devices(collections.OrderedDict(
          [("steps", jnp.zeros(())), ("loss_sum", jnp.zeros(()))]))
    self._stats = self._update(self._stats)
    return {}

  def evaluate(self, **unused):
    return {}


def test_an_ordered_dict_resumes_key_for_key(tmp_path):
  _train(OrderedStatsBuiltInFirstStep, disk_config(tmp_path, 2))
  stats = utils.get_first(_train(OrderedStatsBuiltInFirstStep, disk_config(tmp_path, 4))._stats)  # pylint: disable=protected-access
  assert isinstance(stats, collections.OrderedDict)
  assert {name: float(value) for name, value in stats.items()} == {"steps": 4, "loss_sum": 400}
  _, nest = disk_checkpointing.read(str(tmp_path), step=2)
  assert {name: float(value) for name, value in nest["experiment_module"]["stats"].items()} == {
      "steps": 2, "loss_sum": 200}
