"""A published-style experiment whose step keeps its state on `self` and returns `{}`.

The shape that used to abort inside XLA on multi-device CPU backends: nothing
the step returns tells the framework when a step is done. tests/README.md
runs it repeatedly to show the abort is gone:

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/experiments/state_on_self.py \
      --config=tests/experiments/state_on_self.py --jaxline_mode=train_eval_multithreaded
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxline_ng import base_config, experiment, platform, utils

FLAGS = flags.FLAGS


def get_config():
  config = base_config.get_base_config()
  config.training_steps = 3000
  config.interval_type = "steps"
  config.log_tensors_interval = 1000
  config.save_checkpoint_interval = 500
  config.checkpoint_dir = "/tmp/jaxline_ng_state_on_self"
  config.experiment_kwargs = {"hidden": 64}
  return config


def _loss(params, inputs, targets):
  hidden = jnp.tanh(inputs @ params["w1"])
  return jnp.mean((hidden @ params["w2"] - targets) ** 2)


@functools.partial(jax.pmap, axis_name="i", donate_argnums=0)
def _update(params, inputs, targets):
  grads = jax.grad(_loss)(params, inputs, targets)
  grads = jax.lax.pmean(grads, axis_name="i")
  return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)


@functools.partial(jax.pmap, axis_name="i")
def _eval_loss(params, inputs, targets):
  return jax.lax.pmean(_loss(params, inputs, targets), axis_name="i")


class Experiment(experiment.AbstractExperiment):
  CHECKPOINT_ATTRS = {"_params": "params"}

  def __init__(self, mode, init_rng, hidden):
    super().__init__(mode=mode)
    rng = np.random.default_rng(0)
    self._params = utils.bcast_local_devices({
        "w1": jnp.asarray(rng.normal(size=(8, hidden)) / 3, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(hidden, 1)) / 8, jnp.float32)})
    self._inputs = utils.bcast_local_devices(jnp.asarray(rng.normal(size=(16, 8)), jnp.float32))
    self._targets = jnp.sum(self._inputs, axis=-1, keepdims=True) / 4

  def step(self, *, global_step, rng, writer):
    self._params = _update(self._params, self._inputs, self._targets)
    return {}

  def evaluate(self, *, global_step, rng, writer):
    return {"loss": float(utils.get_first(
        _eval_loss(self._params, self._inputs, self._targets)))}


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(functools.partial(platform.main, Experiment))
