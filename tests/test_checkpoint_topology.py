"""Disk checkpoints resumed on another topology, and sharded over several processes.

Real processes: the toy experiment run with other device counts (fake CPU
devices), other process counts (`jaxline_ng.launch` over loopback) and other
meshes, each resuming the checkpoint the previous run wrote.
"""

import json
import os
import shutil

import numpy as np
import pytest
from helpers import devices_env, launch_command, run, toy_command, toy_experiment
from jax.sharding import PartitionSpec
from test_mesh import Recorder  # the same loss recorder

from jaxline_ng import disk_checkpointing, mesh

toy = toy_experiment()


def toy_args(checkpoint_dir, steps, *extra):
  return toy_command(checkpoint_dir, f"--config.training_steps={steps}",
                     "--config.log_train_data_interval=1", *extra)


def on_devices(command, devices):
  return run(command, timeout=180, env=devices_env(devices))


def launch(command):
  return run(launch_command(command), timeout=240)


def logged_losses(run_dir):
  with open(run_dir / "train" / "metrics.jsonl") as f:
    return {row["step"]: row["loss"] for row in map(json.loads, f)}


def test_pmap_checkpoint_resumes_on_4_then_2_then_1_devices(tmp_path):
  for devices, steps in ((4, 10), (2, 20), (1, 30)):
    result = on_devices(toy_args(tmp_path, steps), devices)
    assert result.returncode == 0, result.stderr[-3000:]
    if devices != 4:
      assert f"Restored checkpoint {tmp_path}/checkpoints/latest/{steps - 10}" in result.stderr
      assert f"continues from step {steps - 10} with the same key chain" in result.stderr
      assert f"x {devices * 2} device(s), this run is pmap on 1 process(es) x {devices}" in \
          result.stderr
  assert sorted(logged_losses(tmp_path)) == list(range(1, 31))
  step, nest = disk_checkpointing.read(str(tmp_path))
  assert step == 30 and nest["train_step_rng"].shape == (1, 2)
  evaluation = on_devices(toy_args(tmp_path, 30, "--jaxline_mode=eval",
                                   "--config.one_off_evaluate=True"), 2)
  assert evaluation.returncode == 0, evaluation.stderr[-3000:]
  assert "key chain" not in evaluation.stderr  # Evaluation takes no key from it.


def test_pmap_checkpoint_resumes_on_another_process_count(tmp_path):
  first = on_devices(toy_args(tmp_path, 10), 4)
  assert first.returncode == 0, first.stderr[-3000:]
  resumed = launch(toy_args(tmp_path, 20))
  assert resumed.returncode == 0, resumed.stdout[-4000:]
  assert "continues from step 10 with the same key chain" in resumed.stdout
  assert sorted(logged_losses(tmp_path)) == list(range(1, 21))


def test_the_key_chain_continues_on_another_device_count(tmp_path):
  """The chain is the same on every device, so it does not depend on the topology."""
  assert on_devices(toy_args(tmp_path / "a", 12), 4).returncode == 0
  assert on_devices(toy_args(tmp_path / "b", 10), 4).returncode == 0
  resumed = on_devices(toy_args(tmp_path / "b", 12), 2)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  uninterrupted = disk_checkpointing.read(str(tmp_path / "a"))[1]["train_step_rng"]
  moved = disk_checkpointing.read(str(tmp_path / "b"))[1]["train_step_rng"]
  assert uninterrupted.shape == (4, 2) and moved.shape == (2, 2)
  np.testing.assert_array_equal(moved, uninterrupted[:2])


MESH_ARGS = ("--config.placement=mesh", "--config.mesh_shape=data:-1,model:4",
             "--config.experiment_kwargs.config.dim=4",
             "--config.random_mode_train=same_host_same_device")


def test_mesh_params_sharded_over_two_processes_save_resume_and_match(tmp_path):
  straight = launch(toy_args(tmp_path / "straight", 30, *MESH_ARGS))
  assert straight.returncode == 0, straight.stdout[-4000:]
  # Both processes wrote their own shards of each checkpoint.
  state_dir = tmp_path / "straight" / "checkpoints" / "latest" / "20" / "state"
  assert {"process_0", "process_1"} <= set(os.listdir(state_dir / "array_metadatas"))
  # The same run as if stopped before saving step 30 (a launch fewer than
  # running it to step 20 again): the rerun resumes from step 20.
  shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "latest" / "30")
  second = launch(toy_args(tmp_path / "resumed", 30, *MESH_ARGS))
  assert second.returncode == 0, second.stdout[-4000:]
  restored = [line for line in second.stdout.splitlines() if "Restored checkpoint" in line]
  assert sorted(line.split()[0] for line in restored) == ["[p0]", "[p1]"]
  assert all("/checkpoints/latest/20" in line for line in restored), restored
  assert logged_losses(tmp_path / "resumed") == logged_losses(tmp_path / "straight")
  with open(tmp_path / "resumed" / "train" / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == list(range(1, 31))  # None twice.
  _, want = disk_checkpointing.read(str(tmp_path / "straight"))
  _, got = disk_checkpointing.read(str(tmp_path / "resumed"))
  np.testing.assert_array_equal(got["experiment_module"]["params"],
                                want["experiment_module"]["params"])


@pytest.fixture
def back_to_pmap_mode():
  yield
  mesh._active[0] = mesh.PMAP  # pylint: disable=protected-access


def test_mesh_checkpoint_restores_onto_another_mesh_shape(tmp_path, back_to_pmap_mode):
  del back_to_pmap_mode
  from jaxline_ng import train  # pylint: disable=import-outside-toplevel

  def run(steps, mesh_shape, run_dir):
    config = toy.get_config()
    config.unlock()
    config.placement, config.mesh_shape = "mesh", mesh_shape
    config.training_steps, config.checkpointer = steps, "disk"
    config.log_train_data_interval, config.checkpoint_dir = 1, str(run_dir)
    config.experiment_kwargs.config.dim = 4
    writer = Recorder()
    checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
    train.train(toy.Experiment, config, checkpointer, writer)
    return writer.losses, checkpointer.get_experiment_state("latest").experiment_module

  straight, _ = run(30, "data:-1,model:2", tmp_path / "straight")
  first, _ = run(20, "data:-1,model:2", tmp_path / "resumed")
  second, resumed = run(30, "data:1,model:4", tmp_path / "resumed")
  assert sorted(second) == list(range(21, 31))
  assert resumed._params.sharding.spec == PartitionSpec("model")
  assert dict(resumed._params.sharding.mesh.shape) == {"data": 1, "model": 4}
  losses = {**first, **second}
  np.testing.assert_allclose([losses[s] for s in range(1, 31)],
                             [straight[s] for s in range(1, 31)], rtol=1e-5)


def test_a_mesh_save_makes_no_device_copy_and_keeps_its_step_while_training_donates(
    tmp_path, back_to_pmap_mode, monkeypatch):
  del back_to_pmap_mode
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from jaxline_ng import base_config, devices, experiment  # pylint: disable=import-outside-toplevel

  class Weights(experiment.AbstractExperiment):
    CHECKPOINT_ATTRS = {"_params": "params"}

    def __init__(self, mode, init_rng=None):
      super().__init__(mode, init_rng)
      self._params = mesh.place(jnp.arange(256 * 1024, dtype=jnp.float32).reshape(256, 1024),
                                "model")

    def step(self, **unused):
      return {}

    def evaluate(self, **unused):
      return {}

  config = base_config.get_base_config()
  config.placement, config.mesh_shape = "mesh", "model:-1"
  config.checkpointer, config.checkpoint_dir = "disk", str(tmp_path)
  mesh.activate(config)
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  state = checkpointer.get_experiment_state("latest")
  state.experiment_module, state.global_step = Weights("train"), 1
  state.train_step_rng = mesh.placement().replicate(jax.random.PRNGKey(0))
  # Orbax's own copy to the host is the save's only one: a device copy doubled its memory.
  monkeypatch.setattr(devices, "fresh_copies", lambda tree: pytest.fail("copied on the devices"))
  checkpointer.save("latest")
  # The next step donates the arrays the save was handed while orbax still writes them.
  module = state.experiment_module
  module._params = jax.jit(lambda p: p * 0 - 1, donate_argnums=0)(module._params)  # pylint: disable=protected-access
  checkpointer.wait_for_checkpointing_to_finish()
  _, nest = disk_checkpointing.read(str(tmp_path))
  np.testing.assert_array_equal(nest["experiment_module"]["params"],
                                np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024))
  # Stored uncompressed: zstd would cost each save and restore CPU time for little disk.
  state_dir = tmp_path / "checkpoints" / "latest" / "1" / "state"
  assert sum(f.stat().st_size for f in state_dir.rglob("*") if f.is_file()) >= 256 * 1024 * 4
