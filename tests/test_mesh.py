"""Mesh mode: the same experiment on jit + NamedSharding, checked against pmap mode."""

import os
import sys

import helpers
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxline_ng import (
  base_config,
  checkpointing,
  disk_checkpointing,
  errors,
  mesh,
  multihost,
  rng,
  train,
  utils,
)

toy = helpers.toy_experiment()


class Recorder:

  def __init__(self):
    self.losses = {}

  def write_scalars(self, global_step, scalars):
    self.losses[global_step] = scalars["loss"]

  def flush(self):
    pass


@pytest.fixture(autouse=True)
def back_to_pmap_mode():
  yield
  mesh._active[0] = mesh.PMAP  # pylint: disable=protected-access


def toy_config(tmp_path, placement, steps=50, **overrides):
  config = toy.get_config()
  config.placement = placement
  config.training_steps = steps
  config.log_train_data_interval = 1
  config.log_tensors_interval = 1000
  config.checkpoint_dir = str(tmp_path)
  config.experiment_kwargs.config.dim = 4
  for key, value in overrides.items():
    config[key] = value
  return config


def run(config, checkpointer=None):
  writer = Recorder()
  checkpointer = checkpointer or checkpointing.InMemoryCheckpointer(config, "train")
  train.train(toy.Experiment, config, checkpointer, writer)
  return writer.losses, checkpointer.get_experiment_state("latest").experiment_module


def test_mesh_mode_matches_pmap_mode_for_50_steps(tmp_path):
  pmap_losses, pmap_exp = run(toy_config(tmp_path, "pmap"))
  utils.GLOBAL_CHECKPOINT_DICT.clear()
  mesh_losses, mesh_exp = run(toy_config(tmp_path, "mesh", mesh_shape="data:-1,model:2"))
  assert sorted(mesh_losses) == list(range(1, 51))
  np.testing.assert_allclose([mesh_losses[s] for s in range(1, 51)],
                             [pmap_losses[s] for s in range(1, 51)], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(mesh_exp._params),
                             np.asarray(utils.get_first(pmap_exp._params)), rtol=1e-5)


def test_step_gets_scalar_step_and_one_key(tmp_path):
  seen = []

  class Recording(toy.Experiment):

    def step(self, global_step, rng, writer):  # pylint: disable=redefined-outer-name
      seen.append((global_step, rng.shape, rng.dtype, rng.sharding.spec))
      return super().step(global_step, rng, writer)

  config = toy_config(tmp_path, "mesh", steps=2)
  train.train(Recording, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  # The step count is a host int32 scalar (reading it costs nothing), the key replicated.
  assert [type(step) for step, *_ in seen] == [np.int32, np.int32]
  assert seen == [(0, (2,), np.uint32, PartitionSpec()), (1, (2,), np.uint32, PartitionSpec())]


def test_mesh_resume_from_disk_continues_identically_with_shardings(tmp_path):
  straight_losses, straight = run(
      toy_config(tmp_path / "a", "mesh", mesh_shape="data:-1,model:2", checkpointer="disk"),
      None)
  config = toy_config(tmp_path / "b", "mesh", steps=20, mesh_shape="data:-1,model:2",
                      checkpointer="disk")
  first_losses, _ = run(config, disk_checkpointing.DiskCheckpointer(config, "train"))
  config.training_steps = 50
  second_losses, resumed = run(config, disk_checkpointing.DiskCheckpointer(config, "train"))
  assert {**first_losses, **second_losses} == straight_losses
  np.testing.assert_array_equal(np.asarray(resumed._params), np.asarray(straight._params))
  assert resumed._params.sharding.spec == PartitionSpec("model")


def test_unique_host_keys_need_one_process_in_mesh_mode(monkeypatch, tmp_path):
  mesh.activate(toy_config(tmp_path, "mesh"))
  assert rng.eval_keys(0, "unique_host_unique_device").shape == (2,)
  rng.check_mesh_random_mode("unique_host_unique_device", "random_mode_train")
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match="mesh-mode step takes one global key"):
    rng.check_mesh_random_mode("unique_host_unique_device", "random_mode_train")
  with pytest.raises(ValueError, match="random_mode_eval"):
    rng.eval_keys(0, "unique_host_unique_device")


@pytest.mark.parametrize("shape,message", [
    ("data:3", "has 3 positions for 4 devices"),
    ("data:-1,model:3", "do not split"),
    ("data:-1,model:-1", "at most one -1"),
    ("data", "expected 'name:size"),
    (None, "expected 'name:size"),
])
def test_bad_mesh_shape_is_named(shape, message):
  config = base_config.get_base_config()
  config.placement, config.mesh_shape = "mesh", shape
  with pytest.raises(base_config.ConfigError, match=f"config.mesh_shape={shape!r}.*{message}"):
    base_config.validate_config(config)


def test_helpers_place_and_replicate(tmp_path):
  mesh.activate(toy_config(tmp_path, "mesh", mesh_shape="data:2,model:2"))
  assert mesh.current_mesh().shape == {"data": 2, "model": 2}
  x = mesh.place(np.arange(8.0), "data")
  assert x.sharding.spec == PartitionSpec("data")
  assert mesh.replicate({"a": np.ones(2)})["a"].sharding.is_fully_replicated
  batch = mesh.global_batch(np.arange(8.0).reshape(4, 2), "data")
  assert batch.shape == (4, 2) and batch.sharding.spec == PartitionSpec("data")


@pytest.mark.parametrize("helper,culprit", [
    (lambda rows: mesh.global_batch({"x": rows}, "data"),
     "global_batch: the global batch['x'] of shape (6, 2): its axis 0 (6) does not split over "
     "mesh axis 'data' of 4 devices; make it a multiple of 4"),
    (lambda rows: mesh.global_batch_from_every_row(rows, "data"),
     "global_batch_from_every_row: the batch of shape (6, 2): its axis 0 (6)"),
    (lambda rows: mesh.place([rows], None, ("data",)),
     "place: the value[0] of shape (6, 2): its axis 1 (2) does not split over mesh axis 'data' "
     "of 4 devices"),
])
def test_rows_that_do_not_split_over_the_mesh_are_one_line_naming_them(tmp_path, helper, culprit):
  """Before, JAX's IndivisibleError came from inside device_put, as a traceback."""
  mesh.activate(toy_config(tmp_path, "mesh"))
  with pytest.raises(multihost.ShardingShapeError) as raised:
    helper(np.zeros((6, 2), np.float32))
  assert isinstance(raised.value, errors.OneLineError) and culprit in str(raised.value)


def test_parameters_that_do_not_split_over_the_model_axis_end_the_run_in_one_line(tmp_path):
  result = helpers.run(
      [sys.executable, helpers.TOY, f"--config={helpers.TOY}",
       f"--config.checkpoint_dir={tmp_path}", "--config.placement=mesh",
       "--config.mesh_shape=data:2,model:2", "--config.experiment_kwargs.config.dim=3"],
      timeout=60)
  assert result.returncode == 1
  assert "Traceback" not in result.stderr, result.stderr[-2000:]
  assert ("jaxline_ng: error: place: the value of shape (3,): its axis 0 (3) does not split over "
          "mesh axis 'model' of 2 devices; make it a multiple of 2") in result.stderr


def test_a_mesh_experiment_run_with_pmap_placement_is_one_line_naming_the_key(tmp_path):
  """It was a RuntimeError traceback from inside the experiment's __init__."""
  script = tmp_path / "mesh_only.py"
  script.write_text(
      "import functools\n"
      "import jax.numpy as jnp\n"
      "from absl import app\n"
      "from jaxline_ng import base_config, experiment, mesh, platform\n"
      "def get_config():\n"
      "  config = base_config.get_base_config()\n"
      "  config.placement = 'mesh'\n"
      "  config.tensorboard = False\n"
      "  return config\n"
      "class Experiment(experiment.AbstractExperiment):\n"
      "  CHECKPOINT_ATTRS = {'_w': 'w'}\n"
      "  def __init__(self, mode, init_rng):\n"
      "    super().__init__(mode=mode, init_rng=init_rng)\n"
      "    self._w = mesh.replicate(jnp.zeros(2))\n"
      "  def step(self, global_step, rng, writer):\n"
      "    return {}\n"
      "  def evaluate(self, global_step, rng, writer):\n"
      "    return {}\n"
      "if __name__ == '__main__':\n"
      "  app.run(functools.partial(platform.main, Experiment))\n")
  result = helpers.run([sys.executable, str(script), f"--config={script}",
                        f"--config.checkpoint_dir={tmp_path}", "--config.placement=pmap"],
                       timeout=60)
  assert result.returncode == 1
  assert "Traceback" not in result.stderr, result.stderr[-2000:]
  assert ("jaxline_ng: error: the experiment uses the mesh, but config.placement is not 'mesh'"
          in result.stderr)


def test_disable_pmap_jit_in_mesh_mode(tmp_path):
  result = helpers.run(
      [sys.executable, helpers.TOY, f"--config={helpers.TOY}",
       f"--config.checkpoint_dir={tmp_path}", "--config.placement=mesh",
       "--config.training_steps=3", "--jaxline_disable_pmap_jit"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert "run eagerly" in result.stderr
  assert helpers.read_jsonl(tmp_path / "train" / "metrics.jsonl")[-1]["step"] == 3


class WithUncommittedCount(toy.Experiment):
  """Mesh-mode state as optax leaves it: a step counter made outside jit,
  which jit moves to the mesh's devices whenever it meets their arrays."""
  CHECKPOINT_ATTRS = {"_params": "params", "_count": "count"}

  def __init__(self, mode, init_rng, config):
    super().__init__(mode, init_rng, config)
    self._count = jax.numpy.zeros((), jax.numpy.int32)
    self._bump = jax.jit(lambda count, params: count + (params.sum() > -1))

  def step(self, global_step, rng, writer):
    self._count = self._bump(self._count, self._params)
    return super().step(global_step, rng, writer)


def resumed_mesh_run(experiment_class, tmp_path):
  """`experiment_class` trained on disk to step 2, then resumed to 4: its experiment."""
  config = toy_config(tmp_path, "mesh", steps=2, mesh_shape="data:-1,model:2",
                      checkpointer="disk")
  train.train(experiment_class, config, disk_checkpointing.DiskCheckpointer(config, "train"),
              Recorder())
  config.training_steps = 4
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  train.train(experiment_class, config, checkpointer, Recorder())
  return checkpointer.get_experiment_state("latest").experiment_module


def test_a_mesh_run_resumes_state_that_init_left_uncommitted(tmp_path):
  assert int(resumed_mesh_run(WithUncommittedCount, tmp_path)._count) == 4  # pylint: disable=protected-access


class WithTable(toy.Experiment):
  """A value among CHECKPOINT_ATTRS not placed on the mesh: part of the model, shape fixed."""
  CHECKPOINT_ATTRS = {"_params": "params", "_table": "table"}
  TABLE = 5
  xp = np

  def __init__(self, mode, init_rng, config):
    super().__init__(mode, init_rng, config)
    self._table = self.xp.zeros(self.TABLE, np.float32)


@pytest.mark.parametrize("xp", [np, jax.numpy])
def test_a_mesh_checkpoint_of_another_model_shape_off_the_mesh_is_refused(tmp_path, xp):
  """A NumPy array, or a JAX array on one device (as a one-device mesh's are): before, the
  latter took the saved shape as a buffer that grows does."""
  table = type("Table", (WithTable,), {"xp": xp})
  config = toy_config(tmp_path, "mesh", steps=2, checkpointer="disk")
  train.train(table, config, disk_checkpointing.DiskCheckpointer(config, "train"), Recorder())
  config.training_steps = 4
  wider = type("WiderTable", (table,), {"TABLE": 7})
  with pytest.raises(disk_checkpointing.CheckpointRefused,
                     match=r"table has shape \(5,\) but the experiment's __init__ makes it \(7,\)"):
    train.train(wider, config, disk_checkpointing.DiskCheckpointer(config, "train"), Recorder())


class WithGrowingState(toy.Experiment):
  """State that changes as it trains, with the same code: NON_BROADCAST histories that grow,
  replicated, sharded along the axis they grow on (one to sizes its sharding cannot split), a
  model EMA filled at the first step, and a weakly typed model scalar that takes bfloat16."""

  def __init__(self, mode, init_rng, config):
    super().__init__(mode, init_rng, config)
    self.NON_BROADCAST_CHECKPOINT_ATTRS = {**self.NON_BROADCAST_CHECKPOINT_ATTRS,
                                           "_history": "history", "_rows": "rows", "_odd": "odd"}
    self.CHECKPOINT_ATTRS = {**self.CHECKPOINT_ATTRS, "_ema": "ema", "_scale": "scale"}
    self._history = mesh.place(jax.numpy.zeros((0,)))
    self._rows = mesh.place(jax.numpy.zeros((0,)), "data")
    self._odd = mesh.place(jax.numpy.zeros((2,)), "data")  # Grows to sizes "data" cannot split.
    self._ema = {}
    self._scale = mesh.replicate(jax.numpy.asarray(1.0))

  def step(self, global_step, rng, writer):
    self._history = jax.numpy.append(self._history, global_step)
    self._rows = jax.numpy.append(self._rows, jax.numpy.full(2, global_step))
    self._odd = jax.numpy.append(self._odd, jax.numpy.full(global_step + 1, global_step))
    self._ema = {"params": self._params * 1}  # A copy: the step donates `_params`.
    self._scale = self._scale * jax.numpy.bfloat16(1)
    return super().step(global_step, rng, writer)


def test_mesh_state_that_changes_as_it_trains_resumes_as_saved(tmp_path):
  """Before, the same code could not resume: refused for the histories' and the scale's
  changes since `__init__`, a traceback for the EMA."""
  resumed = resumed_mesh_run(WithGrowingState, tmp_path)
  np.testing.assert_array_equal(np.asarray(resumed._history), [0, 1, 2, 3])  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(resumed._rows), [0, 0, 1, 1, 2, 2, 3, 3])  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(resumed._odd), [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3])  # pylint: disable=protected-access
  assert resumed._scale.dtype == jax.numpy.bfloat16  # pylint: disable=protected-access
  assert len(resumed._ema["params"].sharding.device_set) == jax.device_count()  # pylint: disable=protected-access


def test_a_truncated_shard_of_a_mesh_checkpoint_is_reported_in_one_line(tmp_path):
  # Large enough that orbax keeps it in a data file of its own, not inline.
  config = toy_config(tmp_path, "mesh", steps=2, mesh_shape="data:-1,model:2",
                      checkpointer="disk")
  config.experiment_kwargs.config.dim = 1 << 16
  run(config, disk_checkpointing.DiskCheckpointer(config, "train"))
  data = [p for p in (tmp_path / "checkpoints" / "latest" / "2" / "state").rglob("*")
          if p.is_file() and p.parent.name == "d"]
  biggest = max(data, key=lambda p: p.stat().st_size)
  os.truncate(biggest, biggest.stat().st_size // 2)
  with pytest.raises(disk_checkpointing.CheckpointRefused, match="its arrays do not load") as e:
    run(config, disk_checkpointing.DiskCheckpointer(config, "train"))
  assert "\n" not in str(e.value) and "TensorStore details" not in str(e.value), str(e.value)
