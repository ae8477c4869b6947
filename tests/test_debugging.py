"""--jaxline_disable_pmap_jit: steps run eagerly, so breakpoints see values."""

import concurrent.futures
import sys

import helpers
import jax
import jax.numpy as jnp

from jaxline_ng import debugging, devices, mesh, rng

# An experiment with a pmap built at import time (as some published code does)
# and a pmap and a jit built in __init__ (as most does); each reports what it
# was handed.
SCRIPT = '''
import functools, sys
import jax, jax.numpy as jnp
from absl import app, flags
from jaxline_ng import base_config, experiment, platform, utils

def get_config():
  config = base_config.get_base_config()
  config.training_steps = 2
  config.log_train_data_interval = None
  config.tensorboard = False
  return config

def _observe(x):
  print("PMAP_SEES", type(x).__name__, repr(x).replace("\\n", " "), flush=True)
  return x + 1

observe = jax.pmap(_observe, axis_name="i")

class Experiment(experiment.AbstractExperiment):
  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._jitted = jax.jit(lambda x: (print("JIT_SEES", type(x).__name__, flush=True), x)[1])
    self._pmapped = jax.pmap(
        lambda x: (print("INIT_PMAP_SEES", type(x).__name__, flush=True), x)[1], axis_name="i")
    self._x = utils.bcast_local_devices(jnp.arange(3.0))

  def step(self, **unused):
    self._x = observe(self._x)
    self._jitted(jnp.ones(2))
    self._pmapped(self._x)
    return {}

  def evaluate(self, **unused):
    return {}

if __name__ == "__main__":
  app.run(functools.partial(platform.main, Experiment))
'''


def run(tmp_path, *flags_):
  tmp_path.mkdir(parents=True, exist_ok=True)
  script = tmp_path / "debug_exp.py"
  script.write_text(SCRIPT)
  return helpers.run([sys.executable, str(script), f"--config={script}",
                      f"--config.checkpoint_dir={tmp_path}", *flags_], env=helpers.devices_env(2))


def test_disable_pmap_jit_runs_steps_eagerly(tmp_path):
  flags_ = ("--jaxline_disable_pmap_jit", "--disable_pmap_jit")
  # Both runs at once: each is mostly one core's import and start-up.
  with concurrent.futures.ThreadPoolExecutor(len(flags_)) as pool:
    results = list(pool.map(lambda flag: run(tmp_path / flag.strip("-"), flag), flags_))
  for result in results:
    assert result.returncode == 0, result.stderr
    pmap_lines = [line for line in result.stdout.splitlines() if line.startswith("PMAP_SEES")]
    # Called every step (eager), not traced once, and showing each device's values.
    assert len(pmap_lines) == 2
    assert "cpu:0" in pmap_lines[0] and "cpu:1" in pmap_lines[0]
    assert "[0. 1. 2.]" in pmap_lines[0] and "[1. 2. 3.]" in pmap_lines[1]
    jit_lines = [line for line in result.stdout.splitlines() if line.startswith("JIT_SEES")]
    assert jit_lines == ["JIT_SEES ArrayImpl"] * 2
    # As in jaxline: a pmap created under the switch is chex's vmap, called
    # every step, fast, its values batched in one tracer.
    init_pmap_lines = [line for line in result.stdout.splitlines()
                       if line.startswith("INIT_PMAP_SEES")]
    assert init_pmap_lines == ["INIT_PMAP_SEES BatchTracer"] * 2
    assert "run eagerly" in result.stderr


def test_disable_pmap_jit_reaches_the_training_thread_of_train_eval_multithreaded(tmp_path):
  # `jax.disable_jit` holds for the thread that enters it: the trainer's
  # thread ran the import-time pmap and jits compiled.
  result = run(tmp_path, "--jaxline_disable_pmap_jit", "--jaxline_mode=train_eval_multithreaded")
  assert result.returncode == 0, result.stderr
  pmap_lines = [line for line in result.stdout.splitlines() if line.startswith("PMAP_SEES")]
  assert len(pmap_lines) == 2  # Called every step, not traced once.
  assert "[0. 1. 2.]" in pmap_lines[0] and "[1. 2. 3.]" in pmap_lines[1]
  assert [line for line in result.stdout.splitlines()
          if line.startswith("JIT_SEES")] == ["JIT_SEES ArrayImpl"] * 2


def test_without_the_flag_steps_are_compiled(tmp_path):
  result = run(tmp_path)
  assert result.returncode == 0, result.stderr
  pmap_lines = [line for line in result.stdout.splitlines() if line.startswith("PMAP_SEES")]
  assert len(pmap_lines) == 1 and "Tracer" in pmap_lines[0]


def test_own_device_helpers_stay_compiled_under_disable_jit():
  """The switch's `jax.disable_jit()` is for the experiment's code: run op by
  op, the step keys, snapshot copies and checksums made saves far slower."""
  traces = []

  @debugging.compiled
  def double(x):
    traces.append(x)
    return x * 2

  rng._split_step.jitted.clear_cache()  # pylint: disable=protected-access
  with jax.disable_jit():
    assert (double(jnp.ones(3)) == 2).all() and (double(jnp.ones(3)) == 2).all()
    rng.StepKeys("unique_host_unique_device").next(mesh.placement().replicate(jax.random.PRNGKey(0)))
    copies = devices.fresh_copies({"w": jnp.arange(4.0)})
  assert len(traces) == 1  # Traced once, then compiled; eager would run the body each call.
  assert rng._split_step.jitted._cache_size() == 1  # pylint: disable=protected-access
  assert (copies["w"] == jnp.arange(4.0)).all()
