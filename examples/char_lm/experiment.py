"""Char LM: a small byte-level transformer trained on Python's own source code.

The text is a fixed, sorted set of standard-library modules read from the
running interpreter's installation, so nothing is downloaded; the last tenth
of each module is held out for evaluation. Train and evaluate in one process:

  python examples/char_lm/experiment.py --config=examples/char_lm/experiment.py \
      --jaxline_mode=train_eval_multithreaded --config.checkpoint_dir=/tmp/char_lm

Measured with that command on a 2-core CPU (4 fake devices, while the machine
was also busy with other work), Python 3.11's standard library:
  * default (677k parameters): 1000 steps in 6-7.5 min, eval_bits_per_char 1.84
  * `:tiny` (137k parameters): 1000 steps in 53 s,    eval_bits_per_char 2.07
  * `:smoke`: the tiny model with one layer, for 10 steps, for tests.
(Other Python versions ship slightly different text, so numbers vary a little.)

Mesh mode (jit + NamedSharding instead of pmap), the weight matrices sharded
over a `model` axis of 2 devices and the batch over `data`:

  python examples/char_lm/experiment.py --config=examples/char_lm/experiment.py:tiny \
      --config.placement=mesh --config.mesh_shape=data:-1,model:2

What to look at when forking:
  * `get_config`: config arguments (`:tiny`), and a FieldReference tying the
    learning-rate schedule's length to `training_steps`.
  * `NON_BROADCAST_CHECKPOINT_ATTRS`: a host-side count of examples consumed,
    checkpointed whole, from which the data stream resumes.
  * `_update`: warmup + cosine learning rate, gradient clipping, pmean.
  * `_place_for_mesh`: the same model in mesh mode, parameters sharded.
  * `evaluate`: bits per character over every held-out window.
"""

import functools
import math
import os

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from ml_collections import config_dict

from jaxline_ng import base_config, experiment, mesh, platform, utils

# Bytes, not characters: no vocabulary to build or store, and these sources
# are (almost) all ASCII, so bits per byte are bits per character.
VOCAB_SIZE = 256
# Sorted and fixed: the same text, in the same order, on every run.
SOURCE_FILES = (
    "argparse.py", "collections/__init__.py", "contextlib.py", "dataclasses.py",
    "enum.py", "functools.py", "heapq.py", "inspect.py", "pathlib.py", "string.py",
    "textwrap.py", "typing.py",
)
# The last tenth of every file is held out: the same mix of code, comments
# and docstrings as the training text, never trained on.
HELD_OUT_FRACTION = 0.1


# ----------------------------------------------------------------------------
# Config.
# ----------------------------------------------------------------------------


def get_config(arg: str = ""):
  """The char LM config: `""` (default), `"tiny"` (small and quick), `"smoke"` (tests).

  Commands and measurements (2-core CPU, 4 fake devices) are in the module
  docstring.
  """
  if arg not in ("", "tiny", "smoke"):
    raise ValueError(f"unknown config argument {arg!r}; expected '', 'tiny' or 'smoke'")
  tiny = arg in ("tiny", "smoke")

  config = base_config.get_base_config()
  # One value in two places: `--config.training_steps=N` also shortens the
  # learning-rate schedule, which lives in experiment_kwargs.
  training_steps = config_dict.FieldReference(10 if arg == "smoke" else 1000)
  config.training_steps = training_steps
  config.interval_type = "steps"
  config.log_tensors_interval = 5 if arg == "smoke" else 100
  config.log_train_data_interval = 5 if arg == "smoke" else 50
  config.save_checkpoint_interval = 5 if arg == "smoke" else 250
  config.checkpoint_dir = "/tmp/jaxline_ng_char_lm"
  config.best_model_eval_metric = "eval_bits_per_char"
  config.best_model_eval_metric_higher_is_better = False

  config.experiment_kwargs = config_dict.ConfigDict(dict(config=dict(
      training_steps=training_steps,
      # Windows of `seq_len` + 1 bytes per step, split over all devices: a
      # multiple of jax.device_count().
      global_batch_size=32,
      eval_batch_size=64,
      seq_len=64 if tiny else 128,
      data_seed=0,
      optimizer=dict(
          peak_learning_rate=3e-3 if tiny else 2e-3,
          warmup_steps=5 if arg == "smoke" else 100,
          final_learning_rate_fraction=0.1,
          weight_decay=0.01,
          max_grad_norm=1.0,
      ),
      model=dict(
          num_layers={"": 3, "tiny": 2, "smoke": 1}[arg],
          num_heads=4,
          model_size=64 if tiny else 128,
          dropout_rate=0.0 if tiny else 0.1,
      ),
  )))
  config.lock()
  return config


# ----------------------------------------------------------------------------
# Data.
# ----------------------------------------------------------------------------


def load_split():
  """(train, held_out) bytes of `SOURCE_FILES` as uint8 arrays.

  Each file is split at 90 % of its length; the heads are concatenated into
  the training text, the tails into the held-out text.
  """
  stdlib = os.path.dirname(os.__file__)
  train, held_out = [], []
  for name in SOURCE_FILES:
    with open(os.path.join(stdlib, name), "rb") as f:
      text = f.read()
    cut = int(len(text) * (1 - HELD_OUT_FRACTION))
    train.append(text[:cut])
    held_out.append(text[cut:])
  as_array = lambda chunks: np.frombuffer(b"\n".join(chunks), np.uint8)
  return as_array(train), as_array(held_out)


def window_starts(first_example: int, count: int, num_starts: int, seed: int) -> np.ndarray:
  """Start offsets of training examples `first_example` .. `first_example + count - 1`.

  Example j is a window at an offset drawn from its own (seed, j) stream, so
  it is the same whatever batch it falls in: the data contract is "the
  stream of examples is fixed; a run resumes at the number of examples it
  has consumed" (`Experiment._examples_seen`), which survives a change of
  batch size or device count between runs.
  """
  return np.array([np.random.default_rng([seed, j]).integers(num_starts)
                   for j in range(first_example, first_example + count)])


# ----------------------------------------------------------------------------
# Model.
# ----------------------------------------------------------------------------


def transformer_lm(tokens, is_training: bool, *, num_layers, num_heads, model_size,
                   dropout_rate):
  """A pre-LayerNorm causal transformer: tokens [B, T] -> next-byte logits [B, T, V]."""
  seq_len = tokens.shape[-1]
  init = hk.initializers.TruncatedNormal(0.02)
  # Residual branches are scaled down with depth so the sum starts small.
  branch_init = hk.initializers.TruncatedNormal(0.02 / math.sqrt(2 * num_layers))
  dropout = lambda x: hk.dropout(hk.next_rng_key(), dropout_rate, x) if (
      is_training and dropout_rate) else x
  layer_norm = lambda x: hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)

  positions = hk.get_parameter("positions", [seq_len, model_size], init=init)
  x = hk.Embed(VOCAB_SIZE, model_size, w_init=init)(tokens) + positions
  causal = jnp.tril(jnp.ones((1, 1, seq_len, seq_len), bool))  # [B, heads, T, T]
  for _ in range(num_layers):
    h = layer_norm(x)
    attention = hk.MultiHeadAttention(num_heads, key_size=model_size // num_heads,
                                      model_size=model_size, w_init=branch_init)
    x = x + dropout(attention(h, h, h, mask=causal))
    h = layer_norm(x)
    h = jax.nn.gelu(hk.Linear(4 * model_size, w_init=init)(h))
    x = x + dropout(hk.Linear(model_size, w_init=branch_init)(h))
  return hk.Linear(VOCAB_SIZE, w_init=init)(layer_norm(x))


def next_byte_losses(logits, windows):
  """Cross-entropy (nats) of predicting windows[:, 1:] from windows[:, :-1]."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])


# ----------------------------------------------------------------------------
# Experiment.
# ----------------------------------------------------------------------------


class Experiment(experiment.AbstractExperiment):
  """Data-parallel training of `transformer_lm`; bits per character on held-out modules."""

  # Replicated per device; one copy is checkpointed.
  CHECKPOINT_ATTRS = {"_params": "params", "_opt_state": "opt_state"}
  # Host-side state, checkpointed as it is (no device axis, not replicated).
  NON_BROADCAST_CHECKPOINT_ATTRS = {"_examples_seen": "examples_seen"}

  def __init__(self, mode, init_rng, config):
    super().__init__(mode=mode, init_rng=init_rng)
    self.config = config

    # pmap mode splits the batch over every device; mesh mode over the `data`
    # axis alone, and the framework names a batch that does not split.
    if mesh.active_mesh() is None and config.global_batch_size % jax.device_count():
      raise base_config.ConfigError(  # One line naming the key, not a traceback.
          f"config.experiment_kwargs.config.global_batch_size={config.global_batch_size} is "
          f"not divisible by the {jax.device_count()} devices; use a multiple of "
          f"{jax.device_count()}")
    self._per_device_batch = config.global_batch_size // jax.device_count()

    self._train_text, self._eval_text = load_split()
    self._net = hk.transform(functools.partial(transformer_lm, **config.model))
    opt = config.optimizer
    self._schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opt.peak_learning_rate, warmup_steps=opt.warmup_steps,
        decay_steps=max(config.training_steps, opt.warmup_steps + 1),
        end_value=opt.peak_learning_rate * opt.final_learning_rate_fraction)
    self._optimizer = optax.chain(
        optax.clip_by_global_norm(opt.max_grad_norm),
        optax.adamw(self._schedule, weight_decay=opt.weight_decay))

    dummy = np.zeros((1, config.seq_len), np.int32)
    # Jitted: one compilation, not one per initializer op.
    init = jax.jit(self._net.init, static_argnames="is_training")
    params = init(init_rng, dummy, is_training=True)
    self._examples_seen = 0
    self._mesh = mesh.active_mesh()
    if self._mesh is None:
      self._params = utils.bcast_local_devices(params)
      self._opt_state = utils.bcast_local_devices(self._optimizer.init(params))
      self._update_step = jax.pmap(self._update, axis_name="i", donate_argnums=(0, 1))
    else:
      self._place_for_mesh(params)
    self._eval_losses = jax.jit(self._eval_sum)
    self._train_input = None  # Built at the first step, after any restore.

  def _place_for_mesh(self, params):
    """Mesh mode: weight matrices split over `model` (if the mesh has it), the rest replicated.

    The optimizer's moments have the parameters' shapes and get the same
    placement by the same rule; the update is one jit over global arrays.
    """
    model_axis_size = dict(self._mesh.shape).get("model", 1)

    def place(tree):
      def sharding(leaf):
        if model_axis_size > 1 and leaf.ndim == 2 and leaf.shape[-1] % model_axis_size == 0:
          return mesh.sharding(None, "model")
        return mesh.sharding()
      return jax.device_put(tree, jax.tree.map(sharding, tree))

    self._params = place(params)
    self._opt_state = place(self._optimizer.init(params))
    self._update_step = jax.jit(functools.partial(self._update, axis_name=None),
                                donate_argnums=(0, 1))

  # --- Training. ---

  def _train_batches(self, first_example: int):
    """Yields [local devices, per-device batch, seq_len + 1] windows of bytes (pmap mode),
    or the global [batch, seq_len + 1] batch sharded over `data` (mesh mode)."""
    num_local = jax.local_device_count()
    per_process = num_local * self._per_device_batch
    num_starts = len(self._train_text) - self.config.seq_len - 1
    offsets = np.arange(self.config.seq_len + 1)
    position = first_example
    while True:
      if self._mesh is None:
        mine = position + jax.process_index() * per_process
        starts = window_starts(mine, per_process, num_starts, self.config.data_seed)
        windows = self._train_text[starts[:, None] + offsets].astype(np.int32)
        yield windows.reshape(num_local, self._per_device_batch, -1)
      else:
        # Every process makes the whole batch (cheap, and a function of the
        # position) and places the rows its devices hold, whatever the mesh:
        # nothing is communicated on this prefetch thread.
        starts = window_starts(position, self.config.global_batch_size, num_starts,
                               self.config.data_seed)
        windows = self._train_text[starts[:, None] + offsets].astype(np.int32)
        yield mesh.global_batch_from_every_row(windows, "data")
      position += self.config.global_batch_size

  def _update(self, params, opt_state, windows, rng, global_step, axis_name="i"):
    """One step. pmap mode averages over devices along `axis_name`; in mesh mode
    (`axis_name=None`) the arrays are global and the mean is already global."""
    mean_over_devices = (lambda x: jax.lax.pmean(x, axis_name=axis_name)) if axis_name else (
        lambda x: x)

    def loss_fn(p):
      logits = self._net.apply(p, rng, windows[:, :-1], is_training=True)
      return jnp.mean(next_byte_losses(logits, windows))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = mean_over_devices(grads)
    updates, opt_state = self._optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    scalars = {"train_bits_per_char": mean_over_devices(loss) / math.log(2),
               "learning_rate": self._schedule(global_step),
               "grad_norm": optax.global_norm(grads)}
    return params, opt_state, scalars

  def step(self, global_step, rng, writer):
    del writer  # The framework writes the returned scalars.
    if self._train_input is None:
      # Resume the example stream where the restored counter says.
      first_example = self._examples_seen
      batches = utils.py_prefetch(lambda: self._train_batches(first_example))
      # pmap mode copies each batch to the devices one step ahead; mesh mode's
      # batches are placed already, on the prefetch thread.
      self._train_input = utils.double_buffer(batches) if self._mesh is None else batches
    # `rng` (one key per device in pmap mode, one key in mesh mode) drives dropout.
    self._params, self._opt_state, scalars = self._update_step(
        self._params, self._opt_state, next(self._train_input), rng, global_step)
    # Counted when consumed, not when prefetched: a checkpoint taken after
    # this step must resume from the next unseen example.
    self._examples_seen += self.config.global_batch_size
    return dict(scalars, examples_seen=self._examples_seen)

  # --- Evaluation. ---

  def _eval_sum(self, params, windows, mask):
    logits = self._net.apply(params, None, windows[:, :-1], is_training=False)
    return jnp.sum(next_byte_losses(logits, windows) * mask[:, None])

  def evaluate(self, global_step, rng, writer):
    del rng, writer  # Deterministic; the framework writes the returned scalars.
    params = utils.get_first(self._params) if self._mesh is None else self._params
    seq_len, batch_size = self.config.seq_len, self.config.eval_batch_size
    # Every held-out byte after the first is predicted once: consecutive
    # windows overlap by the one byte that is input to one and target of the other.
    num_windows = (len(self._eval_text) - 1) // seq_len
    starts = np.arange(num_windows) * seq_len
    windows = self._eval_text[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)

    total = 0.0
    for first in range(0, num_windows, batch_size):
      batch = windows[first:first + batch_size]
      # Pad the last batch (one compiled shape); the mask drops the padding.
      pad = batch_size - len(batch)
      mask = np.concatenate([np.ones(len(batch)), np.zeros(pad)]).astype(np.float32)
      total += self._eval_losses(params, np.pad(batch, ((0, pad), (0, 0))), mask)
    bits_per_char = total / (num_windows * seq_len) / math.log(2)
    return {"eval_bits_per_char": bits_per_char}


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(functools.partial(platform.main, Experiment))
