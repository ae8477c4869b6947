"""The digits example's ConvNet: `jaxline_ng.train` against a hand-written loop of the same model.

Both build the example's `Experiment` (its data, parameters and pmapped
update); the hand-written loop then calls that update itself under the
framework's contract (a fresh per-device key split from a kept chain by one
jitted call each step, the loss read every 100 steps), where the framework
calls `step`. Neither logs to files or checkpoints.
"""

import importlib.util
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
  """examples/digits/experiment.py as a module (examples/ is no package)."""
  spec = importlib.util.spec_from_file_location(
      "digits_experiment", os.path.join(ROOT, "examples", "digits", "experiment.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _config(module, warmup: int, steps: int):
  config = module.get_config()
  config.unlock()
  config.training_steps = warmup + steps
  config.log_tensors_interval = 100
  config.log_train_data_interval = None
  config.save_checkpoint_interval = 10**9
  return config


def hand(warmup: int, steps: int, step_keys) -> dict:
  """Steps/s of the hand-written loop after `warmup` steps.

  Args:
    warmup: steps run before timing (the first compiles).
    steps: steps timed.
    step_keys: `chain -> (per-device step keys, next chain)`, jitted here.
  Returns:
    {"steps_per_sec": ...}.
  """
  import jax  # pylint: disable=import-outside-toplevel

  from jaxline_ng import utils  # pylint: disable=import-outside-toplevel
  module = _example()
  config = _config(module, warmup, steps)
  exp = module.Experiment("train", jax.random.PRNGKey(0), **config.experiment_kwargs)
  next_keys = jax.jit(step_keys)
  chain = utils.bcast_local_devices(jax.random.PRNGKey(0))
  local, per_device = jax.local_device_count(), exp._per_device_batch  # pylint: disable=protected-access
  params, opt_state = exp._params, exp._opt_state  # pylint: disable=protected-access
  start = None
  for step in range(1, warmup + steps + 1):
    batch = jax.tree.map(lambda x: x.reshape((local, per_device) + x.shape[1:]),
                         next(exp._train_input))  # pylint: disable=protected-access
    step_key, chain = next_keys(chain)
    params, opt_state, scalars = exp._update_pmap(  # pylint: disable=protected-access
        params, opt_state, batch, step_key)
    if step % 100 == 0:
      float(scalars["train_loss"].addressable_shards[0].data[0])
    if step == warmup:
      jax.block_until_ready(scalars)
      start = time.perf_counter()
  jax.block_until_ready(scalars)
  return {"steps_per_sec": steps / (time.perf_counter() - start)}


def framework(warmup: int, steps: int, timer_and_rate) -> dict:
  """Steps/s of `jaxline_ng.train` on the example after `warmup` steps.

  Args:
    warmup: steps run before timing.
    steps: steps timed.
    timer_and_rate: `(warmup, steps) -> (periodic action, () -> steps/s)`.
  Returns:
    {"steps_per_sec": ...}.
  """
  import tempfile  # pylint: disable=import-outside-toplevel

  from jaxline_ng import checkpointing, train  # pylint: disable=import-outside-toplevel
  module = _example()
  config = _config(module, warmup, steps)
  with tempfile.TemporaryDirectory(prefix="jaxline_ng_bench_") as checkpoint_dir:
    config.checkpoint_dir = checkpoint_dir
    timer, steps_per_sec = timer_and_rate(warmup, steps)
    train.train(module.Experiment, config, checkpointing.InMemoryCheckpointer(config, "train"),
                None, [timer])
  return {"steps_per_sec": steps_per_sec()}
