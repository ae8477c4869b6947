"""In-memory checkpoints: both published snapshot layouts, rebinding, and restore."""

import threading
from unittest import mock

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxline_ng import base_config, checkpointing, experiment, train, utils


class Params(experiment.AbstractExperiment):
  CHECKPOINT_ATTRS = {"_params": "params", "_opt_state": "opt_state"}
  NON_BROADCAST_CHECKPOINT_ATTRS = {"_epoch": "epoch"}
  seen = []

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._params = utils.bcast_local_devices({"w": jnp.zeros(3)})
    self._opt_state = None
    self._epoch = 0

  def step(self, global_step, **unused):
    Params.seen.append(int(utils.get_first(global_step)))
    return {}

  def evaluate(self, **unused):
    return {"w0": utils.get_first(self._params)["w"][0]}


def config_for(steps):
  config = base_config.get_base_config()
  config.training_steps = steps
  return config


def run_train(steps):
  Params.seen = []
  config = config_for(steps)
  train.train(Params, config, checkpointing.InMemoryCheckpointer(config, "train"), None)


def test_restores_jaxline_008_layout_built_by_hand(monkeypatch):
  """`pickle_nest['experiment_module']` is a snapshot_state() dict (jaxline 0.0.8)."""
  nest = {"global_step": 4,
          "experiment_module": {"params": {"w": np.full(3, 7.0, np.float32)},
                                "opt_state": None, "epoch": 2}}
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {
      "latest": utils.CheckpointNT(threading.local(), [utils.SnapshotNT(0, nest)])})
  run_train(6)
  assert Params.seen == [4, 5]
  state = checkpointing.InMemoryCheckpointer(config_for(6), "train").get_experiment_state("latest")
  assert state.experiment_module._epoch == 2
  np.testing.assert_array_equal(utils.get_first(state.experiment_module._params)["w"],
                                np.full(3, 7.0))


def test_restores_pre_008_layout_holding_the_experiment(monkeypatch):
  """Older published code stores the experiment object itself in the snapshot."""
  old = Params("train", None)
  old._params = utils.bcast_local_devices({"w": jnp.full(3, 5.0)})
  old._epoch = 9
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {
      "latest": utils.CheckpointNT(threading.local(), [
          utils.SnapshotNT(0, {"global_step": 3, "experiment_module": old})])})
  run_train(5)
  assert Params.seen == [3, 4]
  state = checkpointing.InMemoryCheckpointer(config_for(5), "train").get_experiment_state("latest")
  assert state.experiment_module._epoch == 9
  # The final save is in the 0.0.8 layout, copied to host.
  final = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest
  assert final["global_step"] == 5
  np.testing.assert_array_equal(final["experiment_module"]["params"]["w"], np.full(3, 5.0))


def test_rebinding_utils_dict_is_honoured(monkeypatch):
  mine = {}
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", mine)
  run_train(2)
  assert mine["latest"].history[-1].pickle_nest["global_step"] == 2


def test_threads_have_their_own_live_state(monkeypatch):
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {})
  checkpointer = checkpointing.InMemoryCheckpointer(config_for(1), "train")
  main_state = checkpointer.get_experiment_state("latest")
  other = []
  thread = threading.Thread(
      target=lambda: other.append(checkpointer.get_experiment_state("latest")))
  thread.start()
  thread.join()
  assert other[0] is not main_state
  assert checkpointer.get_experiment_state("latest") is main_state


def test_restore_path_changes_with_each_save(monkeypatch):
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {})
  checkpointer = checkpointing.InMemoryCheckpointer(config_for(1), "train")
  assert checkpointer.restore_path("latest") is None
  assert not checkpointer.can_be_restored("latest")
  checkpointer.save("latest")
  checkpointer.wait_for_checkpointing_to_finish()
  first = checkpointer.restore_path("latest")
  checkpointer.save("latest")
  checkpointer.wait_for_checkpointing_to_finish()
  assert checkpointer.restore_path("latest") != first


def test_checkpoint_attrs_as_instance_property(monkeypatch):
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {})

  class PropertyAttrs(Params):

    @property
    def CHECKPOINT_ATTRS(self):  # pylint: disable=invalid-name
      return {"_params": "weights"}

  config = config_for(2)
  train.train(PropertyAttrs, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  snapshot = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest["experiment_module"]
  assert set(snapshot) == {"weights", "epoch"}


def test_get_checkpoint_dir_creates_per_host_dir(tmp_path):
  config = config_for(1)
  config.checkpoint_dir = str(tmp_path)
  path = utils.get_checkpoint_dir(config, 3)
  assert path.startswith(str(tmp_path)) and "3" in path
  assert (tmp_path / path.split("/")[-1]).is_dir()


def test_in_memory_save_is_in_the_history_when_save_returns():
  """jaxline's contract: code reads `history[-1]` right after `save()`."""
  config = config_for(3)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "train")
  state = checkpointer.get_experiment_state("latest")
  state.experiment_module = Params("train", None)
  for step in range(1, 5):
    state.global_step = step
    state.experiment_module._params = utils.bcast_local_devices({"w": jnp.full(3, float(step))})  # pylint: disable=protected-access
    checkpointer.save("latest")
    # A copy: training donating (deleting) the live buffers leaves it intact.
    jax.tree.map(lambda a: a.delete(), state.experiment_module._params)  # pylint: disable=protected-access
    newest = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1]
    assert newest.id == step - 1
    assert isinstance(newest.pickle_nest, ml_collections.ConfigDict)
    assert newest.pickle_nest.global_step == step
    w = newest.pickle_nest.experiment_module.params.w
    np.testing.assert_array_equal(np.asarray(w), np.full(3, float(step)))


def test_restore_right_after_save_restores_that_save():
  config = config_for(5)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "train")
  state = checkpointer.get_experiment_state("latest")
  state.experiment_module = Params("train", None)
  for step in (1, 2):
    state.global_step = step
    state.experiment_module._params = utils.bcast_local_devices({"w": jnp.full(3, float(step))})  # pylint: disable=protected-access
    checkpointer.save("latest")
  state.global_step = 99
  state.experiment_module._params = utils.bcast_local_devices({"w": jnp.zeros(3)})  # pylint: disable=protected-access
  checkpointer.restore("latest")
  assert state.global_step == 2
  np.testing.assert_array_equal(utils.get_first(state.experiment_module._params)["w"],  # pylint: disable=protected-access
                                np.full(3, 2.0))


def test_a_save_the_guard_vetoes_is_never_visible_to_a_reader():
  """The check comes before the snapshot joins the history, so a reader (the
  evaluator of `train_eval_multithreaded`) can never restore a state the guard
  refuses. Checking after appending, on another thread, let an evaluator
  restore and evaluate such states, and save one as `best`."""
  config = config_for(3)
  config.max_checkpoints_to_keep = 1
  checkpointer = checkpointing.InMemoryCheckpointer(config, "train")
  state = checkpointer.get_experiment_state("latest")
  state.experiment_module = Params("train", None)
  state.global_step = 1
  checkpointer.save("latest", validate=lambda: None)
  history = utils.GLOBAL_CHECKPOINT_DICT["latest"].history
  seen_during_check = []

  def veto():
    seen_during_check.append([snapshot.pickle_nest.global_step for snapshot in history])
    raise FloatingPointError("non-finite")

  state.global_step = 2
  with pytest.raises(FloatingPointError):
    checkpointer.save("latest", validate=veto)
  assert seen_during_check == [[1]]
  assert [snapshot.pickle_nest.global_step for snapshot in history] == [1]
  assert checkpointer.restore_path("latest") == 0


def test_typed_prng_keys_round_trip_in_memory():
  """Typed keys (`jax.random.key`) among CHECKPOINT_ATTRS and as the chain
  are saved and restored typed, as jaxline kept them (on the devices)."""

  class Keys(experiment.AbstractExperiment):
    CHECKPOINT_ATTRS = {"_keys": "keys"}

    def __init__(self, mode, init_rng=None):
      super().__init__(mode, init_rng)
      self._keys = utils.bcast_local_devices(jax.random.key(7))  # Replicated, as pmap keeps it.

    def step(self, **unused):
      return {}

    def evaluate(self, **unused):
      return {}

  checkpointer = checkpointing.InMemoryCheckpointer(base_config.get_base_config(), "train")
  state = checkpointer.get_experiment_state("latest")
  state.global_step, state.experiment_module = 0, Keys("train")
  state.train_step_rng = utils.bcast_local_devices(jax.random.key(5))
  saved = jax.random.key_data(state.experiment_module._keys)
  checkpointer.save("latest")
  state.experiment_module._keys = None
  checkpointer.restore("latest")
  keys = state.experiment_module._keys
  assert keys.shape == (jax.local_device_count(),) and jnp.issubdtype(keys.dtype,
                                                                      jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(keys), saved)
  assert state.train_step_rng.shape == (jax.local_device_count(),)


def test_experiment_state_reads_and_prints_as_jaxlines_configdict():
  """Code written for jaxline handles the state as the ConfigDict it was: the
  same operations on both give the same answers, and printing it names its
  entries (`print(best_state)` in published `on_new_best_model`s)."""
  state = checkpointing.InMemoryCheckpointer(
      base_config.get_base_config(), "train").get_experiment_state("best")
  jaxlines = ml_collections.ConfigDict()
  for live in (state, jaxlines):
    live.global_step = 7
    live.update({"best_eval_metric_value": 0.5}, best_model_eval_metric="accuracy")
  for read in (sorted, len, lambda s: sorted(s.keys()), lambda s: sorted(s.values(), key=str),
               lambda s: sorted(s.items()), lambda s: s.to_dict(), lambda s: "global_step" in s,
               lambda s: s["best_eval_metric_value"], lambda s: s.get("missing", 3)):
    assert read(state) == read(jaxlines)
  printed = str(state)
  for name in ("global_step: 7", "best_eval_metric_value: 0.5", "best_model_eval_metric:"):
    assert name in printed


def test_a_subclass_overriding_save_or_restore_loses_what_describes_them():
  """Code written for jaxline subclasses `utils.InMemoryCheckpointer` to save
  elsewhere too: its save takes no `validate`, and its restore sets jaxline's
  entries alone, so the loops must not rely on jaxline_ng's behaviour of them."""

  class SavesElsewhereToo(utils.InMemoryCheckpointer):
    def save(self, ckpt_series):
      super().save(ckpt_series)

  class RestoresFromElsewhere(utils.InMemoryCheckpointer):
    def restore(self, ckpt_series):
      super().restore(ckpt_series)

  class RedeclaresWhatItKeeps(SavesElsewhereToo):
    validates_saves = True
    keeps_run_entries = True

    def save(self, ckpt_series, *, validate=None):
      utils.InMemoryCheckpointer.save(self, ckpt_series, validate=validate)

  assert SavesElsewhereToo.restores_saved_entries and SavesElsewhereToo.in_memory_only
  assert not SavesElsewhereToo.validates_saves and not SavesElsewhereToo.keeps_run_entries
  assert RestoresFromElsewhere.validates_saves
  assert not (RestoresFromElsewhere.keeps_run_entries
              or RestoresFromElsewhere.restores_saved_entries
              or RestoresFromElsewhere.in_memory_only)
  assert RedeclaresWhatItKeeps.validates_saves and RedeclaresWhatItKeeps.keeps_run_entries
  assert utils.InMemoryCheckpointer.validates_saves  # The base class keeps its own.

  checkpointer = SavesElsewhereToo(config_for(3), "train")
  config = config_for(3)
  config.save_checkpoint_interval = 1
  config.checkpoint_interval_type = "steps"
  train.train(Params, config, checkpointer, None)
  saved = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest
  assert set(saved) == {"global_step", "train_step_rng", "experiment_module"}


class JaxlineStyle:
  """A checkpointer written for jaxline: its six methods and nothing else."""

  def __init__(self):
    self.state = ml_collections.ConfigDict()
    self.saved_steps = []

  def get_experiment_state(self, ckpt_series):
    return self.state

  def save(self, ckpt_series):
    self.saved_steps.append(self.state.global_step)

  def can_be_restored(self, ckpt_series):
    return False

  def restore(self, ckpt_series):
    raise AssertionError("nothing to restore")

  def restore_path(self, ckpt_series):
    return None

  def wait_for_checkpointing_to_finish(self):
    pass


def test_a_jaxline_style_checkpointer_is_adapted_once_with_no_capability():
  own = JaxlineStyle()
  adapted = checkpointing.adapt(own)
  assert isinstance(adapted, checkpointing.Checkpointer)
  assert checkpointing.adapt(adapted) is adapted
  assert adapted.class_name == "JaxlineStyle"
  assert not (adapted.validates_saves or adapted.keeps_run_entries or adapted.restores_by_path
              or adapted.restores_saved_entries or adapted.in_memory_only
              or adapted.every_process_saves)
  assert adapted.set_aside("best") is False and adapted.started_from is None
  in_memory = utils.InMemoryCheckpointer(config_for(1), "train")
  assert checkpointing.adapt(in_memory) is in_memory

  config = config_for(3)
  config.save_checkpoint_interval = 1
  config.checkpoint_interval_type = "steps"
  train.train(Params, config, own, None)
  assert own.saved_steps == [1, 2, 3]
  assert set(own.state) == {"global_step", "train_step_rng", "experiment_module"}


def test_the_run_state_is_a_configdict_as_jaxlines():
  state = utils.InMemoryCheckpointer(config_for(1), "train").get_experiment_state("latest")
  assert isinstance(state, ml_collections.ConfigDict) and not state.is_locked


def test_an_eval_job_over_processes_refuses_a_restore_that_cannot_follow_the_chief(tmp_path):
  """Where every process reads each checkpoint together, an override of `restore`
  that does not declare `restores_by_path` would have each choose its own and wait."""
  from jaxline_ng import disk_checkpointing, multihost  # pylint: disable=import-outside-toplevel

  class LogsRestores(disk_checkpointing.DiskCheckpointer):
    def restore(self, ckpt_series, path=None):
      super().restore(ckpt_series, path=path)

  config = config_for(2)
  config.checkpoint_dir = str(tmp_path)
  checkpointer = LogsRestores(config, "eval")
  checkpointer.every_process_saves = True  # As in a mesh run over several processes.
  with mock.patch.object(multihost, "is_multiprocess", return_value=True), \
      pytest.raises(base_config.ConfigError, match=r"^LogsRestores overrides restore .*"
                    r"declare restores_by_path = True"):
    train.evaluate(Params, config, checkpointer, None, jaxline_mode="eval")
