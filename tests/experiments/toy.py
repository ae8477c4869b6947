"""A tiny experiment for end-to-end tests.

    python tests/experiments/toy.py --config=tests/experiments/toy.py

Its parameters are a vector pulled towards a target by data-parallel SGD; the
step's data is a function of the step number, so runs are reproducible. Each
process takes its slice of a global batch, so 1 process x 4 devices and 2
processes x 2 devices train on the same data. It runs in both placements:
`--config.placement=mesh` trains the same math with `jax.jit` on a mesh, the
parameters sharded over a `model` axis when the mesh has one. Config
arguments: `:fail_at_step` makes step 3 raise (crash propagation). Config
keys pace the steps and inject a failure or a NaN loss on one process, a
`sys.exit(0)` or a None returned.
"""

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_dict

from jaxline_ng import base_config, experiment, mesh, multihost, platform, utils
from jaxline_ng import rng as rng_lib


def get_config(arg: str = ""):
  config = base_config.get_base_config()
  config.training_steps = 20
  config.interval_type = "steps"
  config.log_tensors_interval = 5
  config.log_train_data_interval = 5
  config.save_checkpoint_interval = 10
  config.checkpoint_dir = "/tmp/jaxline_ng_toy"
  config.best_model_eval_metric = "neg_distance"
  # Importing TensorFlow is most of a short run's CPU; the tests of
  # TensorBoard output turn it on.
  config.tensorboard = False
  learning_rate = config_dict.FieldReference(0.1)
  config.experiment_kwargs = config_dict.ConfigDict(dict(config=dict(
      learning_rate=learning_rate,
      dim=3,
      fail_at_step=3 if arg == "fail_at_step" else -1,
      fail_on_process=-1,  # With fail_at_step or hang_at_step: only this process (-1: all).
      hang_at_step=-1,  # This step never returns (a stuck collective, say).
      record_keys_dir="",  # Save each process's first step keys, and every mode's, here.
      step_sleep_secs=0.0,  # Paces the steps, so a test can signal a run mid-way.
      nan_from_step=-1,  # From this step on, the loss returned is NaN ...
      nan_on_process=-1,  # ... on this process only (-1: all).
      exit_at_step=-1,  # At this step, sys.exit(0), as a library might call it.
      none_at_step=-1,  # At this step, return None rather than a dict of scalars.
  )))
  config.lock()
  return config


def _loss(params, batch):
  return jnp.mean(jnp.sum((params - batch) ** 2, axis=-1))


def _update(params, batch, learning_rate):
  loss, grads = jax.value_and_grad(_loss)(params, batch)
  grads = jax.lax.pmean(grads, axis_name="i")
  return params - learning_rate * grads, jax.lax.pmean(loss, axis_name="i")


def _update_global(params, batch, learning_rate):
  """`_update` on global arrays: the mean over the whole batch, as pmean gives."""
  loss, grads = jax.value_and_grad(_loss)(params, batch)
  return params - learning_rate * grads, loss


class Experiment(experiment.AbstractExperiment):
  CHECKPOINT_ATTRS = {"_params": "params"}

  def __init__(self, mode, init_rng, config):
    super().__init__(mode=mode, init_rng=init_rng)
    self.config = config
    self._mesh = mesh.active_mesh()
    if self._mesh is not None:
      # A value on one device, as experiments keep counters: in a mesh run of
      # several processes, each saves it as its own host value.
      self.NON_BROADCAST_CHECKPOINT_ATTRS = {"_version": "version"}
      self._version = jnp.int32(1)
    if self._mesh is None:
      self._params = utils.bcast_local_devices(jnp.zeros(config.dim))
      self._update = jax.pmap(
          functools.partial(_update, learning_rate=config.learning_rate), axis_name="i",
          donate_argnums=0)
    else:
      model_axis = "model" if "model" in self._mesh.axis_names else None
      self._params = mesh.place(jnp.zeros(config.dim), model_axis)
      self._update = jax.jit(functools.partial(_update_global, learning_rate=config.learning_rate),
                             donate_argnums=0)

  def _batch(self, step: int):
    rows = np.random.default_rng(step).normal(1.0, 0.1, (jax.device_count(), 8, self.config.dim))
    local = multihost.host_slice(rows.astype(np.float32))
    if self._mesh is None:
      return local
    return mesh.global_batch(local.reshape(-1, self.config.dim), "data")

  def step(self, global_step, rng, writer):
    step = int(global_step if self._mesh is not None else utils.get_first(global_step))
    if step == self.config.fail_at_step and self.config.fail_on_process in (
        -1, jax.process_index()):
      raise RuntimeError(f"toy experiment fails at step {step}")
    # `get`: a config written out by hand may lack the later keys.
    if step == self.config.get("hang_at_step", -1) and self.config.fail_on_process in (
        -1, jax.process_index()):
      while True:
        time.sleep(1)
    if step == self.config.get("exit_at_step", -1):
      sys.exit(0)
    if step == 0 and self.config.record_keys_dir:
      keys = {"step": np.asarray(rng)}
      for mode in rng_lib.RANDOM_MODES:
        keys[mode] = np.asarray(rng_lib.eval_keys(0, mode))
      np.savez(f"{self.config.record_keys_dir}/keys_p{jax.process_index()}.npz", **keys)
    if self.config.step_sleep_secs:
      time.sleep(self.config.step_sleep_secs)
    self._params, loss = self._update(self._params, self._batch(step))
    if 0 <= self.config.nan_from_step <= step and self.config.nan_on_process in (
        -1, jax.process_index()):
      loss = loss * jnp.nan
    if step == self.config.get("none_at_step", -1):
      return None
    return {"loss": loss if self._mesh is not None else utils.get_first(loss)}

  def evaluate(self, global_step, rng, writer):
    params = self._params if self._mesh is not None else utils.get_first(self._params)
    return {"neg_distance": -jnp.linalg.norm(params - 1.0), "params/mean": jnp.mean(params)}


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(functools.partial(platform.main, Experiment))
