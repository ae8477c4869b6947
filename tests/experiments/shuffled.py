"""A tiny experiment whose data is a shuffled dataset read in order, not a function of the step.

    python tests/experiments/shuffled.py --config=tests/experiments/shuffled.py

Its parameters are pulled towards the rows of a small dataset that a grain
pipeline shuffles per epoch and batches; each process reads its own share.
`experiment_kwargs.config.checkpoint_iterator` (default True) lists the
iterator in NON_BROADCAST_CHECKPOINT_ATTRS, so a resume goes on from the
batch it reached; with False, a resumed run reads the data from the start.
"""

import functools

import grain
import jax
import numpy as np
from absl import app, flags
from ml_collections import config_dict

from jaxline_ng import base_config, experiment, platform, utils

ROWS, ROWS_PER_DEVICE, DIM = 24, 2, 3


def get_config():
  config = base_config.get_base_config()
  config.training_steps = 12
  config.interval_type = "steps"
  config.log_tensors_interval = 5
  config.log_train_data_interval = 1
  config.save_checkpoint_interval = 5
  config.checkpoint_dir = "/tmp/jaxline_ng_shuffled"
  config.tensorboard = False
  config.experiment_kwargs = config_dict.ConfigDict(dict(config=dict(
      learning_rate=0.1, shuffle_seed=7, checkpoint_iterator=True)))
  config.lock()
  return config


def _update(params, batch, learning_rate):
  loss, grads = jax.value_and_grad(lambda p: ((p - batch) ** 2).sum(-1).mean())(params)
  grads = jax.lax.pmean(grads, axis_name="i")
  return params - learning_rate * grads, jax.lax.pmean(loss, axis_name="i")


class Experiment(experiment.AbstractExperiment):
  CHECKPOINT_ATTRS = {"_params": "params"}

  def __init__(self, mode, init_rng, config):
    super().__init__(mode=mode, init_rng=init_rng)
    if config.checkpoint_iterator:
      self.NON_BROADCAST_CHECKPOINT_ATTRS = {"_batches": "train_iterator"}
    rows = np.random.default_rng(0).normal(1.0, 0.5, (ROWS, DIM)).astype(np.float32)
    dataset = grain.MapDataset.source(rows).seed(config.shuffle_seed).shuffle().repeat(None)
    dataset = dataset[jax.process_index()::jax.process_count()]
    self._batches = iter(dataset.batch(jax.local_device_count() * ROWS_PER_DEVICE)
                         .to_iter_dataset())
    self._params = utils.bcast_local_devices(np.zeros(DIM, np.float32))
    self._update = jax.pmap(functools.partial(_update, learning_rate=config.learning_rate),
                            axis_name="i", donate_argnums=0)

  def step(self, global_step, rng, writer):
    batch = next(self._batches).reshape(jax.local_device_count(), ROWS_PER_DEVICE, DIM)
    self._params, loss = self._update(self._params, batch)
    return {"loss": utils.get_first(loss)}

  def evaluate(self, global_step, rng, writer):
    return {"params/mean": np.mean(utils.get_first(self._params))}


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(functools.partial(platform.main, Experiment))
