"""The workload every benchmark shares: a small haiku MLP, data-parallel.

The same pmapped update (optax adam, `lax.pmean` of gradients, per-device
batch 32) is driven by a hand-written loop and by `jaxline_ng.train`, so any
difference in steps per second is what the framework costs.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxline_ng import experiment, mesh, utils

PER_DEVICE_BATCH = 32
FEATURES = 32
CLASSES = 10


def _forward(x):
  return hk.nets.MLP([128, 128, CLASSES])(x)


network = hk.without_apply_rng(hk.transform(_forward))
optimizer = optax.adam(1e-3)


def _loss(params, batch, rng):
  noise = 0.01 * jax.random.normal(rng, batch["x"].shape)
  logits = network.apply(params, batch["x"] + noise)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def update(params, opt_state, batch, rng):
  """One data-parallel step; returns new state and the loss (per device)."""
  loss, grads = jax.value_and_grad(_loss)(params, batch, rng)
  grads = jax.lax.pmean(grads, axis_name="i")
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axis_name="i")


def update_global(params, opt_state, batch, rng):
  """`update` on global arrays (mesh mode): the mean over the whole batch."""
  loss, grads = jax.value_and_grad(_loss)(params, batch, rng)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def global_batch():
  """The per-device batches of `device_batch`, as one batch sharded over `data`."""
  n = jax.device_count()
  data = np.random.default_rng(0)
  x = data.normal(size=(PER_DEVICE_BATCH, FEATURES)).astype(np.float32)
  y = data.integers(0, CLASSES, size=(PER_DEVICE_BATCH,)).astype(np.int32)
  return mesh.place({"x": np.tile(x, (n, 1)), "y": np.tile(y, n)}, "data")


def device_batch():
  """A fixed per-device batch, placed once: the benchmarks time the loop, not input."""
  data = np.random.default_rng(0)
  return utils.bcast_local_devices({
      "x": data.normal(size=(PER_DEVICE_BATCH, FEATURES)).astype(np.float32),
      "y": data.integers(0, CLASSES, size=(PER_DEVICE_BATCH,)).astype(np.int32),
  })


def initial_state():
  params = network.init(jax.random.PRNGKey(0), jnp.zeros((1, FEATURES)))
  return params, optimizer.init(params)


class MLPExperiment(experiment.AbstractExperiment):
  """`update` as a jaxline_ng experiment; returns the loss unreduced, so nothing
  is dispatched or fetched for scalars until they are logged."""
  CHECKPOINT_ATTRS = {"_params": "params", "_opt_state": "opt_state"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    params, opt_state = initial_state()
    self._place(params, opt_state)

  def _place(self, params, opt_state):
    """pmap mode: one copy per device, a per-device batch, a pmapped update."""
    self._params = utils.bcast_local_devices(params)
    self._opt_state = utils.bcast_local_devices(opt_state)
    self._batch = device_batch()
    self._update = jax.pmap(update, axis_name="i", donate_argnums=(0, 1))

  def step(self, global_step, rng, writer):
    self._params, self._opt_state, loss = self._update(
        self._params, self._opt_state, self._batch, rng)
    return {"loss": loss}

  def evaluate(self, global_step, rng, writer):
    return {}


class MeshMLPExperiment(MLPExperiment):
  """The same model in mesh mode: replicated params, batch sharded over `data`."""

  def _place(self, params, opt_state):
    self._params, self._opt_state = mesh.replicate((params, opt_state))
    self._batch = global_batch()
    self._update = jax.jit(update_global, donate_argnums=(0, 1))
