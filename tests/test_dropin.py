"""Code written for jaxline 0.0.8 runs with only the import changed.

Each test uses jaxline's documented contract the way jaxline's own tests and
published experiments use it: a constructor without `init_rng`, an
`initialize_train_step_rng(self, rng)` override, a checkpointer that keeps
the state in a `ConfigDict`, a writer with only `write_scalars` and
`write_images`.
"""

import copy
import pickle
import sys
import textwrap
import threading
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run
from ml_collections import config_dict

from jaxline_ng import base_config, checkpointing, errors, experiment, preemption, train, utils


def make_config(**overrides):
  config = base_config.get_base_config()
  config.training_steps = 3
  config.log_tensors_interval = 0
  config.interval_type = "steps"
  for key, value in overrides.items():
    config[key] = value
  return config


# The public names of jaxline 0.0.8's modules (its type variables and
# `train.FLAGS`, an alias of absl's, left out): code written for jaxline may
# reach any of them through the renamed import.
JAXLINE_PUBLIC_NAMES = {
    "base_config": ("check_constraints", "get_base_config", "validate_config", "validate_keys"),
    "experiment": ("AbstractExperiment",),
    "platform": ("TensorBoardLogger", "create_checkpointer", "create_writer", "main"),
    "train": ("evaluate", "train"),
    "utils": ("CheckpointNT", "Checkpointer", "DistributedRNGMode", "GLOBAL_CHECKPOINT_DICT",
              "InMemoryCheckpointer", "PeriodicAction", "SnapshotNT", "Writer",
              "bcast_local_devices", "debugger_fallback", "disable_pmap_jit", "double_buffer",
              "double_buffer_on_gpu", "evaluate_should_return_dict", "get_first",
              "host_id_devices_for_rng", "kwargs_only", "log_activity", "make_async",
              "maybe_device_get", "py_prefetch", "rendezvous", "specialize_rng_host_device",
              "tree_psum"),
}


@pytest.mark.parametrize("module", sorted(JAXLINE_PUBLIC_NAMES))
def test_every_public_name_of_jaxlines_modules_exists(module):
  ours = __import__(f"jaxline_ng.{module}", fromlist=["_"])
  assert [name for name in JAXLINE_PUBLIC_NAMES[module] if not hasattr(ours, name)] == []


class NoInitRng(experiment.AbstractExperiment):
  """jaxline's test experiment shape: no init_rng, an rng-initialising override."""

  CHECKPOINT_ATTRS = {"_w": "w"}
  NON_BROADCAST_CHECKPOINT_ATTRS = {"_count": "count"}

  def __init__(self, mode, scale=1.0):
    super().__init__(mode=mode)
    self.scale = scale
    self.init_arg = None
    self.step_rngs = []
    self._w = utils.bcast_local_devices(jnp.zeros(2))
    self._count = 0

  def initialize_train_step_rng(self, rng):
    self.init_arg = rng
    return super().initialize_train_step_rng(rng)

  def step(self, *, global_step, rng, writer):
    del global_step, writer
    self.step_rngs.append(rng)
    self._w = self._w + self.scale
    self._count += 1
    return {"loss": -1}

  def evaluate(self, *, global_step, rng, writer):
    del global_step, rng, writer
    return {"w": float(utils.get_first(self._w)[0])}


class ConfigDictCheckpointer:
  """A user's checkpointer in jaxline's style: the state is a ConfigDict, and
  every save keeps a shallow copy of it (as jaxline's DummyCheckpoint does)."""

  def __init__(self):
    self._state = config_dict.ConfigDict()
    self.saved = []

  def get_experiment_state(self, unused_series):
    return self._state

  def save(self, unused_series):
    self.saved.append({k: v for k, v in self._state.items()})

  def can_be_restored(self, unused_series):
    return False

  def restore(self, unused_series):
    raise AssertionError("nothing to restore")

  def restore_path(self, unused_series):
    return None

  def wait_for_checkpointing_to_finish(self):
    pass


class MinimalWriter:
  """jaxline's Writer protocol: write_scalars and write_images, nothing else."""

  def __init__(self):
    self.scalars = []

  def write_scalars(self, global_step, scalars):
    self.scalars.append((global_step, dict(scalars)))

  def write_images(self, global_step, images):
    del global_step, images


def test_constructor_without_init_rng_is_called_as_jaxline_does():
  config = make_config(experiment_kwargs=config_dict.ConfigDict({"scale": 2.0}))
  with mock.patch("absl.logging.warning") as warning:
    train.train(NoInitRng, config, ConfigDictCheckpointer(), None)
  assert any("init_rng" in str(call) for call in warning.call_args_list)


def test_initialize_train_step_rng_gets_one_key_and_places_it_per_device():
  checkpointer = ConfigDictCheckpointer()
  train.train(NoInitRng, make_config(), checkpointer, None)
  state = checkpointer.get_experiment_state("latest")
  module = state.experiment_module
  # jaxline: the seed's key split in two, the first half to the chain.
  np.testing.assert_array_equal(module.init_arg, jax.random.split(jax.random.PRNGKey(42))[0])
  assert state.train_step_rng.shape == (jax.local_device_count(), 2)
  assert len(module.step_rngs) == 3
  assert all(r.shape == (jax.local_device_count(), 2) for r in module.step_rngs)
  assert len({np.asarray(r).tobytes() for r in module.step_rngs}) == 3


@pytest.mark.parametrize("interval_type", ["secs", "steps"])
def test_train_runs_with_a_mock_checkpointer_and_writer(interval_type):
  """How published tests call jaxline's train (BraVe's `experiment_test.py`):
  everything a Mock is asked for exists, and jaxline's loops asked only for
  its methods. jaxline_ng read a Mock's made-up attributes as its own facts."""
  checkpointer, writer = mock.Mock(), mock.Mock()
  config = make_config(interval_type=interval_type, training_steps=2)
  train.train(NoInitRng, config, checkpointer, writer)
  checkpointer.get_experiment_state.assert_called_with("latest")
  checkpointer.save.assert_called_with("latest")
  assert checkpointer.get_experiment_state.return_value.global_step == 2


def test_an_eval_job_runs_with_a_mock_checkpointer():
  checkpointer, writer = mock.Mock(), mock.Mock()
  train.evaluate(NoInitRng, make_config(one_off_evaluate=True), checkpointer, writer,
                 jaxline_mode="eval")
  assert writer.write_scalars.called


def test_train_runs_with_a_checkpointer_that_forwards_to_another():
  class Forwarding:  # Methods found through __getattr__ alone, not on the class.
    def __init__(self, inner):
      self._inner = inner

    def __getattr__(self, name):
      return getattr(self._inner, name)

  config = make_config()
  inner = checkpointing.InMemoryCheckpointer(config, "train")
  train.train(NoInitRng, config, Forwarding(inner), None)
  assert inner.get_experiment_state("latest").global_step == 3


def test_a_configdict_checkpointer_sees_jaxlines_entries_as_plain_values():
  checkpointer = ConfigDictCheckpointer()
  config = make_config(save_checkpoint_interval=1, training_steps=4)
  train.train(NoInitRng, config, checkpointer, None)
  assert [saved["global_step"] for saved in checkpointer.saved] == [1, 2, 3, 4]
  for saved in checkpointer.saved:
    # jaxline's entries alone: a checkpointer may save them with a library
    # that refuses other types (orbax refuses a string), or lock its state.
    assert set(saved) == {"global_step", "train_step_rng", "experiment_module"}
    assert type(saved["global_step"]) is int
    assert isinstance(saved["train_step_rng"], jax.Array)
  # Every save's key is the real chain at that step, usable as it is.
  keys = [np.asarray(saved["train_step_rng"]) for saved in checkpointer.saved]
  assert len({k.tobytes() for k in keys}) == 4


def test_a_writer_with_only_jaxlines_two_methods_works_in_train_and_evaluate():
  writer = MinimalWriter()
  config = make_config(log_train_data_interval=1)
  train.train(NoInitRng, config, ConfigDictCheckpointer(), writer)
  assert [step for step, _ in writer.scalars] == [1, 2, 3]
  assert all("steps_per_sec" in scalars for _, scalars in writer.scalars[1:])

  class OneCheckpoint(ConfigDictCheckpointer):
    def can_be_restored(self, unused_series):
      return True

    def restore(self, unused_series):
      self._state.global_step = 3

    def restore_path(self, unused_series):
      return "only"

  eval_writer = MinimalWriter()
  train.evaluate(NoInitRng, make_config(), OneCheckpoint(), eval_writer, jaxline_mode="eval")
  assert eval_writer.scalars == [(3, {"w": 0.0})]


def test_log_activity_logs_a_failure_with_its_traceback():
  with mock.patch("absl.logging.exception") as exception:
    with pytest.raises(ValueError, match="Intentional"):
      with utils.log_activity("for test"):
        raise ValueError("Intentional")
  exception.assert_called_once()
  assert "for test" in exception.call_args.args[1]


def test_a_failing_constructor_exits_1_with_its_error_last(tmp_path):
  script = tmp_path / "broken.py"
  script.write_text(textwrap.dedent("""
      import functools
      from absl import app
      from jaxline_ng import base_config, experiment, platform

      def get_config():
        config = base_config.get_base_config()
        config.checkpoint_dir = RUN_DIR
        config.tensorboard = False  # Nothing to show, and TensorFlow's import takes seconds.
        return config

      class Broken(experiment.AbstractExperiment):
        def __init__(self, mode, init_rng):
          raise ValueError("no data at /datasets/missing")
        def step(self, **kwargs):
          pass
        def evaluate(self, **kwargs):
          pass

      if __name__ == "__main__":
        app.run(functools.partial(platform.main, Broken))
      """).replace("RUN_DIR", repr(str(tmp_path / "run"))))
  for mode in ("train", "train_eval_multithreaded"):
    result = run([sys.executable, str(script), f"--config={script}", f"--jaxline_mode={mode}"])
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == "ValueError: no data at /datasets/missing"


class StateOnSelf(experiment.AbstractExperiment):
  """Published style: the step keeps its state on `self` and returns nothing to log."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._params = utils.bcast_local_devices(jnp.ones(64))
    self._update = jax.pmap(lambda p: p + jax.lax.pmean(p, "i") * 1e-6, axis_name="i")

  def step(self, **unused):
    self._params = self._update(self._params)
    return {}

  def evaluate(self, **unused):
    return {"mean": float(utils.get_first(self._params).mean())}


def test_a_step_that_returns_nothing_trains_and_evaluates_side_by_side():
  config = make_config(training_steps=300, save_checkpoint_interval=50,
                       log_tensors_interval=100)
  checkpointer = utils.InMemoryCheckpointer(config, "train")
  train.train_eval_multithreaded(StateOnSelf, config, checkpointer, None)
  assert utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest.global_step == 300


def test_jaxlines_snapshot_test_layout_is_exact():
  """jaxline's own check: only what the loops set is in the snapshot."""
  checkpointer = utils.InMemoryCheckpointer(config_dict.ConfigDict({"max_checkpoints_to_keep": 2}),
                                            "train")
  state = checkpointer.get_experiment_state("series")
  state.global_step = 0
  state.experiment_module = NoInitRng("train")
  checkpointer.save("series")
  nest = copy.deepcopy(utils.GLOBAL_CHECKPOINT_DICT["series"].history[-1].pickle_nest.to_dict())
  assert sorted(nest) == ["experiment_module", "global_step"]
  assert sorted(nest["experiment_module"]) == ["count", "w"]


class FailsToConstruct(NoInitRng):

  def __init__(self, mode, init_rng):
    del init_rng
    super().__init__(mode)
    raise ValueError("no data at /datasets/missing")


def test_a_failing_constructor_leaves_no_framework_thread_running():
  """A thread still working when the process exits can take it down with
  SIGABRT (exit 134) instead of the constructor's error."""
  before = set(threading.enumerate())
  with pytest.raises(ValueError, match="no data"):
    train.train(FailsToConstruct, make_config(), ConfigDictCheckpointer(), None)
  assert set(threading.enumerate()) - before == set()


@pytest.mark.parametrize("overrides, saved_steps", [
    # A steps interval saves at its multiples, plus the final step.
    ({"save_checkpoint_interval": 4, "training_steps": 10}, [4, 8, 10]),
    # jaxline gives the checkpointing action the growth ratios too.
    ({"save_checkpoint_interval": 40, "training_steps": 25,
      "periodic_action_growth_ratios": (1, 2, 5)}, [1, 2, 5, 10, 20, 25]),
    # An interval of 0 means no periodic saves, only the final one (jaxline's `> 0`).
    ({"save_checkpoint_interval": 0, "interval_type": "secs", "training_steps": 6}, [6]),
])
def test_periodic_saves_happen_at_jaxlines_steps(overrides, saved_steps):
  checkpointer = ConfigDictCheckpointer()
  train.train(NoInitRng, make_config(**overrides), checkpointer, None)
  assert [saved["global_step"] for saved in checkpointer.saved] == saved_steps


@pytest.mark.parametrize("error, logged_by", [
    # A requested stop is not a failure: a warning.
    (preemption.Preempted("stopped by SIGTERM after step 7"), "warning"),
    # Bad input: one error line, the message says it all.
    (base_config.ConfigError("config.training_steps='many' is not a number"), "error"),
], ids=["requested_stop", "bad_input"])
def test_log_activity_logs_stops_and_bad_input_without_a_traceback(error, logged_by):
  with mock.patch("absl.logging.exception") as exception, \
      mock.patch(f"absl.logging.{logged_by}") as logged:
    with pytest.raises(type(error)):
      with utils.log_activity("training loop"):
        raise error
  exception.assert_not_called()
  assert str(error) in str(logged.call_args)


class RestartsActionClocks(NoInitRng):
  """A published `train_loop` override (emergent_communication_at_scale's) restarts
  every action's clock, as jaxline's `PeriodicAction.update_time` allows, and adds
  an action of its own to the tuple jaxline passes."""
  acted = []

  def train_loop(self, config, state, periodic_actions, writer=None):
    for action in periodic_actions:
      action.update_time(0.0, state.global_step)
    periodic_actions = periodic_actions + (utils.PeriodicAction(
        lambda step, scalars: self.acted.append(step), "steps", 1, run_async=False),)
    super().train_loop(config, state, periodic_actions, writer)


def test_a_train_loop_override_may_restart_clocks_and_add_actions(tmp_path):
  config = make_config(checkpoint_dir=str(tmp_path), profile_steps=(1, 2))
  checkpointer = ConfigDictCheckpointer()
  train.train(RestartsActionClocks, config, checkpointer, None)
  assert checkpointer.get_experiment_state("latest").global_step == 3
  assert RestartsActionClocks.acted == [1, 2, 3]


class SnapshotOverride(experiment.AbstractExperiment):
  """Published style: no CHECKPOINT_ATTRS; `snapshot_state` and its inverse say what is saved."""

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self.total = 0

  def step(self, **unused):
    self.total += 1
    return {}

  def evaluate(self, **unused):
    return {}

  def snapshot_state(self):
    return {**super().snapshot_state(), "total": self.total}

  def restore_from_snapshot(self, snapshot_state):
    self.total = snapshot_state["total"]


def test_an_overridden_snapshot_state_is_not_called_empty(caplog):
  config = make_config(training_steps=6, save_checkpoint_interval=1)
  with caplog.at_level("INFO", logger="absl"):
    train.train(SnapshotOverride, config, utils.InMemoryCheckpointer(config, "train"), None)
  assert utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest.experiment_module.total == 6
  assert "declares no CHECKPOINT_ATTRS" not in caplog.text
  assert "Checkpointed state: what SnapshotOverride.snapshot_state returns" in caplog.text


class JaxlineStyleCheckpointer:
  """How users copied jaxline's InMemoryCheckpointer into their own code: `restore`
  sets the entries the live state has, the experiment through `restore_from_snapshot`.
  Its series live in `store`, so they outlive the checkpointer (as files would)."""

  def __init__(self, store):
    self._store = store
    self._states = {}
    self.saves = []

  def get_experiment_state(self, series):
    return self._states.setdefault(series, config_dict.ConfigDict())

  def save(self, series):
    state = self.get_experiment_state(series)
    self._store.setdefault(series, []).append({
        name: value.snapshot_state() if name == "experiment_module"
        else jax.tree.map(utils.maybe_device_get, value) for name, value in state.items()})
    self.saves.append((series, state.global_step))

  def can_be_restored(self, series):
    return bool(self._store.get(series))

  def restore(self, series):
    saved, state = self._store[series][-1], self.get_experiment_state(series)
    for name, value in state.items():
      if name == "experiment_module":
        value.restore_from_snapshot(saved[name])
      else:
        state[name] = saved[name]

  def restore_path(self, series):
    return len(self._store[series]) if self.can_be_restored(series) else None

  def wait_for_checkpointing_to_finish(self):
    pass


def test_own_checkpoints_on_every_host_timed_in_seconds_are_refused_as_jaxline_did():
  # Each host would save after another step and resume from it: jaxline's
  # check_constraints refused this; jaxline_ng's checkpointers resume every
  # process from the chief's saves, a checkpointer written for jaxline does not.
  config = make_config(train_checkpoint_all_hosts=True, interval_type="secs")
  from jaxline_ng import multihost  # pylint: disable=import-outside-toplevel
  with mock.patch.object(multihost, "is_multiprocess", return_value=True), \
      pytest.raises(base_config.ConfigError, match=r"config.interval_type='secs' .*"
                    r"train_checkpoint_all_hosts=True .*ConfigDictCheckpointer"):
    train.train(NoInitRng, config, ConfigDictCheckpointer(), None)


def test_a_locked_configdict_state_with_jaxlines_entries_trains():
  class Locked(ConfigDictCheckpointer):
    def __init__(self):
      super().__init__()
      self._state = config_dict.ConfigDict(
          {"global_step": 0, "train_step_rng": None, "experiment_module": None})
      self._state.lock()

  checkpointer = Locked()
  train.train(NoInitRng, make_config(save_checkpoint_interval=1), checkpointer, None)
  assert [saved["global_step"] for saved in checkpointer.saved] == [1, 2, 3]


def test_jaxlines_restore_body_resumes_through_an_in_memory_checkpointer_subclass(tmp_path):
  """A subclass keeping its snapshots in a file, restoring with jaxline's
  `restore` body, which sets `state[name]` for each entry of the live state."""
  saved_to = tmp_path / "snapshot.pickle"

  class PicklesToAFile(utils.InMemoryCheckpointer):
    def save(self, series, **kwargs):
      super().save(series, **kwargs)
      state = self.get_experiment_state(series)
      with open(saved_to, "wb") as f:
        pickle.dump({name: value.snapshot_state() if name == "experiment_module"
                     else jax.device_get(value) for name, value in state.items()}, f)

    def can_be_restored(self, series):
      return saved_to.exists()

    def restore(self, series):
      with open(saved_to, "rb") as f:
        snapshot = pickle.load(f)
      state = self.get_experiment_state(series)
      for name, value in state.items():
        if name == "experiment_module":
          value.restore_from_snapshot(snapshot[name])
        else:
          state[name] = snapshot[name]

  train.train(NoInitRng, make_config(training_steps=3, save_checkpoint_interval=1),
              PicklesToAFile(make_config(), "train"), None)
  utils.GLOBAL_CHECKPOINT_DICT.clear()  # A new process: only the file remains.
  resumed = PicklesToAFile(make_config(), "train")
  train.train(NoInitRng, make_config(training_steps=5, save_checkpoint_interval=1),
              resumed, None)
  state = resumed.get_experiment_state("latest")
  assert state["global_step"] == state.global_step == 5
  with open(saved_to, "rb") as f:  # jaxline's entries alone: it may save them anywhere.
    assert set(pickle.load(f)) == {"global_step", "train_step_rng", "experiment_module"}
  assert state.experiment_module._count == 5  # pylint: disable=protected-access  (3 restored)


def test_a_restarted_evaluator_restores_best_through_a_jaxline_style_checkpointer():
  """jaxline restores `best` into a state holding the experiment and the metric."""
  store = {}
  config = make_config(best_model_eval_metric="w", save_checkpoint_interval=0)
  train.train(NoInitRng, config, JaxlineStyleCheckpointer(store), None)
  first = JaxlineStyleCheckpointer(store)
  train.evaluate(NoInitRng, config, first, None, jaxline_mode="eval")
  assert first.saves == [("best", 3)]
  assert store["best"][-1]["best_model_eval_metric"] == "w"  # In the state, as jaxline's.
  # jaxline's evaluator restores the chain into `latest`, and best takes it from there.
  np.testing.assert_array_equal(store["best"][-1]["train_step_rng"],
                                store["latest"][-1]["train_step_rng"])
  restarted = JaxlineStyleCheckpointer(store)
  train.evaluate(NoInitRng, config, restarted, None, jaxline_mode="eval")
  assert restarted.get_experiment_state("best").best_eval_metric_value == 3.0
  assert restarted.saves == []  # The same value again is no new best.


class TakesConfig(NoInitRng):

  def __init__(self, mode, init_rng, config):
    super().__init__(mode)
    del init_rng, config


@pytest.mark.parametrize("kwargs, culprit", [
    ({"config": {}, "dropout": 0.1}, "unexpected keyword argument 'dropout'"),
    ({}, "missing a required argument: 'config'"),
    (None, "must be a ConfigDict"),
])
def test_experiment_kwargs_the_constructor_does_not_take_are_one_line_naming_them(kwargs, culprit):
  config = make_config()
  with config.unlocked():
    config.experiment_kwargs = None if kwargs is None else config_dict.ConfigDict(kwargs)
  with pytest.raises(base_config.ConfigError, match=culprit) as raised:
    train.train(TakesConfig, config, utils.InMemoryCheckpointer(make_config(), "train"), None)
  assert "config.experiment_kwargs" in str(raised.value)
  assert isinstance(raised.value, errors.OneLineError)


# jaxline 0.0.8's `get_base_config()`: a config built to it (by hand, or
# saved from a jaxline run) has these keys and no others.
JAXLINE_BASE_CONFIG = dict(
    experiment_kwargs={}, training_steps=2, interval_type="secs", save_checkpoint_interval=300,
    log_tensors_interval=60, periodic_action_growth_ratios=None, log_train_data_interval=120.0,
    log_async=True, log_all_hosts=False, logging_interval_type=None,
    checkpoint_interval_type=None, save_initial_train_checkpoint=False,
    train_checkpoint_all_hosts=False, best_checkpoint_all_hosts=False, log_all_train_data=False,
    eval_initial_weights=False, one_off_evaluate=False, max_checkpoints_to_keep=5,
    random_seed=42, random_mode_train="unique_host_unique_device",
    random_mode_eval="same_host_same_device", legacy_random_seed_behavior=False,
    best_model_eval_metric="", best_model_eval_metric_higher_is_better=True)


class PmapInInit(experiment.AbstractExperiment):
  """Records what the pmap it builds in `__init__` is handed: a tracer's type."""
  seen = []

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._add = jax.pmap(lambda x: (PmapInInit.seen.append(type(x).__name__), x + 1)[1],
                         axis_name="i")
    self._x = utils.bcast_local_devices(jnp.zeros(()))

  def step(self, **unused):
    self._x = self._add(self._x)
    return {"x": utils.get_first(self._x)}

  def evaluate(self, **unused):
    self._x = self._add(self._x)
    return {"x": utils.get_first(self._x)}


def test_train_and_evaluate_run_a_config_with_only_jaxlines_keys():
  config = config_dict.ConfigDict(JAXLINE_BASE_CONFIG)
  train.train(PmapInInit, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  assert utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest["global_step"] == 2
  config = config_dict.ConfigDict(JAXLINE_BASE_CONFIG)
  config.one_off_evaluate = True
  train.evaluate(PmapInInit, config, checkpointing.InMemoryCheckpointer(config, "eval"), None,
                 jaxline_mode="eval")


def test_disable_pmap_jit_reaches_train_and_evaluate_called_directly(monkeypatch):
  """jaxline decorated `train` and `evaluate` with `utils.disable_pmap_jit`."""
  from jaxline_ng import debugging  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(debugging, "pmap_jit_disabled", lambda: True)
  config = make_config(training_steps=2)
  PmapInInit.seen = []
  train.train(PmapInInit, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  # chex's fake pmap is a vmap, called (not traced once) at every step.
  assert PmapInInit.seen == ["BatchTracer"] * 2
  PmapInInit.seen = []
  config.one_off_evaluate = True
  train.evaluate(PmapInInit, config, checkpointing.InMemoryCheckpointer(config, "eval"), None,
                 jaxline_mode="eval")
  assert PmapInInit.seen == ["BatchTracer"]


def test_the_disable_pmap_jit_flag_set_by_flagsaver_counts_without_parsing():
  # A test that calls `train.train` under `flagsaver` without parsing the
  # command line: jaxline read the flag (and raised there); it was ignored.
  from absl import flags  # pylint: disable=import-outside-toplevel
  from absl.testing import flagsaver  # pylint: disable=import-outside-toplevel

  from jaxline_ng import debugging  # pylint: disable=import-outside-toplevel
  was_parsed = flags.FLAGS.is_parsed()
  flags.FLAGS.unparse_flags()
  try:
    with flagsaver.flagsaver(jaxline_disable_pmap_jit=True):
      assert debugging.pmap_jit_disabled()
    assert not debugging.pmap_jit_disabled()
  finally:
    if was_parsed:
      flags.FLAGS.mark_as_parsed()


def test_a_periodic_action_takes_jaxlines_keyword_names():
  seen = []
  action = utils.PeriodicAction(lambda step, scalars: seen.append(step), interval_type="steps",
                                interval=1, run_async=False)
  action(t=0.0, step=1, scalar_outputs={"loss": 1.0})
  assert seen == [1]


def test_create_checkpointer_takes_a_config_of_jaxlines_keys_alone():
  # utils_test of jaxline builds its checkpointer from such a config.
  from jaxline_ng import platform  # pylint: disable=import-outside-toplevel
  config = config_dict.ConfigDict({"max_checkpoints_to_keep": 5})
  assert isinstance(platform.create_checkpointer(config, "train"), utils.InMemoryCheckpointer)
