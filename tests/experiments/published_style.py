"""An experiment written the way published jaxline research code is written.

Only the import differs from the jaxline original: `from jaxline_ng import
...` instead of `from jaxline import ...`. Everything else follows the habits
of released research code: module-level pmapped functions with
axis_name='i', parameters initialised lazily at the first step from a
broadcast `init_rng`, `utils.py_prefetch` over a numpy generator,
`utils.get_first` on every output, FieldReferences in a locked config, and
`super().__init__(mode=mode)` without `init_rng`.

  python tests/experiments/published_style.py \
      --config=tests/experiments/published_style.py --jaxline_mode=train_eval_multithreaded
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from ml_collections import config_dict

from jaxline_ng import base_config, experiment, platform, utils

FLAGS = flags.FLAGS

_NUM_FEATURES = 8
_NUM_CLASSES = 2


def get_config():
  """Return config object for training."""
  config = base_config.get_base_config()

  # Shared values, referenced from several places in the config.
  num_steps = config_dict.FieldReference(20)
  train_batch_size = config_dict.FieldReference(16)  # Per device.

  config.experiment_kwargs = config_dict.ConfigDict(
      dict(
          config=dict(
              random_seed=0,
              optimizer=dict(
                  base_lr=3e-2,
                  warmup_steps=num_steps // 4,
              ),
              model=dict(hidden_sizes=(32,)),
              training=dict(
                  batch_size=train_batch_size,
                  num_steps=num_steps,
              ),
              evaluation=dict(
                  batch_size=train_batch_size * 2,
                  num_batches=4,
              ),
          )))

  config.training_steps = num_steps
  config.interval_type = 'steps'
  config.log_train_data_interval = 5
  config.log_tensors_interval = 5
  config.save_checkpoint_interval = 10
  config.eval_specific_checkpoint_dir = ''
  config.checkpoint_dir = '/tmp/jaxline_ng_published_style'
  config.best_model_eval_metric = 'eval_accuracy'

  config.lock()
  return config


def _forward_fn(inputs, hidden_sizes):
  net = hk.nets.MLP(tuple(hidden_sizes) + (_NUM_CLASSES,))
  return net(inputs)


def _loss_fn(params, inputs, labels, hidden_sizes):
  logits = hk.without_apply_rng(hk.transform(
      functools.partial(_forward_fn, hidden_sizes=hidden_sizes))).apply(params, inputs)
  one_hot = jax.nn.one_hot(labels, _NUM_CLASSES)
  loss = jnp.mean(optax.softmax_cross_entropy(logits, one_hot))
  accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
  return loss, accuracy


@functools.partial(jax.pmap, axis_name='i', static_broadcasted_argnums=(2,))
def _init_fn(rng, inputs, hidden_sizes):
  params = hk.transform(
      functools.partial(_forward_fn, hidden_sizes=hidden_sizes)).init(rng, inputs)
  return params, optax.scale_by_adam().init(params)


@functools.partial(
    jax.pmap, axis_name='i', donate_argnums=(0, 1),
    static_broadcasted_argnums=(5, 6, 7))
def _update_fn(params, opt_state, global_step, rng, inputs, base_lr, warmup_steps,
               hidden_sizes):
  """Applies an update to parameters and returns new state."""
  del rng  # Unused: no dropout or augmentation here.
  grad_loss_fn = jax.grad(_loss_fn, has_aux=True)
  grads, accuracy = grad_loss_fn(params, inputs['features'], inputs['labels'],
                                 hidden_sizes)
  grads = jax.lax.pmean(grads, axis_name='i')
  learning_rate = base_lr * jnp.minimum(1., (global_step + 1) / warmup_steps)
  updates, opt_state = optax.scale_by_adam().update(grads, opt_state)
  updates = jax.tree.map(lambda u: -learning_rate * u, updates)
  params = optax.apply_updates(params, updates)
  loss, _ = _loss_fn(params, inputs['features'], inputs['labels'], hidden_sizes)
  scalars = {'train_loss': loss, 'train_accuracy': accuracy,
             'learning_rate': learning_rate}
  scalars = jax.lax.pmean(scalars, axis_name='i')
  return params, opt_state, scalars


@functools.partial(jax.pmap, axis_name='i', static_broadcasted_argnums=(2,))
def _eval_fn(params, inputs, hidden_sizes):
  loss, accuracy = _loss_fn(params, inputs['features'], inputs['labels'],
                            hidden_sizes)
  num = inputs['labels'].shape[0]
  return utils.tree_psum({'loss_sum': loss * num, 'correct': accuracy * num,
                          'count': jnp.asarray(num, jnp.float32)}, axis_name='i')


def _true_weights(seed):
  return np.random.RandomState(seed).normal(size=(_NUM_FEATURES,))


class Experiment(experiment.AbstractExperiment):
  """Linearly separable classification with an MLP."""

  CHECKPOINT_ATTRS = {
      '_params': 'params',
      '_opt_state': 'opt_state',
  }

  def __init__(self, mode, init_rng, config):
    super().__init__(mode=mode)
    self.mode = mode
    self.init_rng = init_rng
    self.config = config

    self._params = None
    self._opt_state = None
    self._train_input = None
    logging.info('Initializing experiment in mode %s.', mode)

  #  _             _
  # | |_ _ __ __ _(_)_ __
  # | __| '__/ _` | | '_ \
  # | |_| | | (_| | | | | |
  #  \__|_|  \__,_|_|_| |_|
  #

  def step(self, global_step, rng, *unused_args, **unused_kwargs):
    """See base class."""
    if self._train_input is None:
      self._initialize_train()

    inputs = next(self._train_input)
    opt = self.config.optimizer
    self._params, self._opt_state, scalars = _update_fn(
        self._params, self._opt_state, global_step, rng, inputs, opt.base_lr,
        opt.warmup_steps, tuple(self.config.model.hidden_sizes))
    scalars = utils.get_first(scalars)
    return scalars

  def _initialize_train(self):
    self._train_input = utils.py_prefetch(self._build_train_input)

    # Check we haven't already restored params.
    if self._params is None:
      logging.info('Initializing parameters.')
      inputs = next(self._train_input)
      init_rng = utils.bcast_local_devices(self.init_rng)
      self._params, self._opt_state = _init_fn(
          init_rng, inputs['features'], tuple(self.config.model.hidden_sizes))

  def _build_train_input(self):
    """Yields per-device batches, [num_devices, batch_size, ...]."""
    num_devices = jax.local_device_count()
    batch_size = self.config.training.batch_size
    rng = np.random.RandomState(self.config.random_seed)
    weights = _true_weights(self.config.random_seed)
    while True:
      features = rng.normal(size=(num_devices, batch_size, _NUM_FEATURES))
      labels = (features @ weights > 0).astype(np.int32)
      yield {'features': features.astype(np.float32), 'labels': labels}

  #                  _
  #   _____   ____ _| |
  #  / _ \ \ / / _` | |
  # |  __/\ V / (_| | |
  #  \___| \_/ \__,_|_|
  #

  def evaluate(self, global_step, rng, writer, **unused_args):
    """See base class."""
    global_step = np.array(utils.get_first(global_step))
    summed = None
    for inputs in self._build_eval_input():
      out = _eval_fn(self._params, inputs, tuple(self.config.model.hidden_sizes))
      out = utils.get_first(out)
      summed = out if summed is None else jax.tree.map(jnp.add, summed, out)
    scalars = {'eval_loss': summed['loss_sum'] / summed['count'],
               'eval_accuracy': summed['correct'] / summed['count']}
    logging.info('[Step %d] Eval scalars: %s', global_step,
                 jax.device_get(scalars))
    return scalars

  def _build_eval_input(self):
    num_devices = jax.local_device_count()
    batch_size = self.config.evaluation.batch_size
    rng = np.random.RandomState(self.config.random_seed + 1)
    weights = _true_weights(self.config.random_seed)
    for _ in range(self.config.evaluation.num_batches):
      features = rng.normal(size=(num_devices, batch_size, _NUM_FEATURES))
      labels = (features @ weights > 0).astype(np.int32)
      yield {'features': features.astype(np.float32), 'labels': labels}


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(functools.partial(platform.main, Experiment))
