"""JAX's persistent compilation cache: by default under checkpoint_dir off CPU, shared, can be off.

JAX's own setting (`JAX_COMPILATION_CACHE_DIR`) is kept when the config leaves the key unset.
"""

import os
import shutil

import helpers
import jax
import pytest
from helpers import run, toy_command
from jax.experimental.compilation_cache import compilation_cache

from jaxline_ng import base_config, persistent_cache

# The toy's programs compile in milliseconds, below JAX's default threshold
# for caching a program (1 s): cache every one, so the test sees them.
# Without the suite's shared cache (conftest.py), which would take precedence.
ENV = {key: value for key, value in helpers.ENV.items() if key != "JAX_COMPILATION_CACHE_DIR"}
ENV.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def toy(checkpoint_dir, *extra, env=ENV):
  result = run(toy_command(checkpoint_dir, "--config.training_steps=4", *extra), env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stderr


def test_cache_is_reused_by_restarts_and_the_eval_job(tmp_path):
  cache = tmp_path / "compilation_cache"
  on = f"--config.compilation_cache_dir={cache}"
  log = toy(tmp_path, on)
  assert f"Compilation cache: {cache}" in log
  assert os.listdir(cache)
  toy(tmp_path, on, "--config.training_steps=8")  # the first restart adds what restoring compiles
  after_train = set(os.listdir(cache))
  toy(tmp_path, on, "--config.training_steps=12")  # the next one compiles nothing new
  assert set(os.listdir(cache)) == after_train
  toy(tmp_path, on, "--jaxline_mode=eval", "--config.one_off_evaluate")
  assert set(os.listdir(cache)) > after_train  # the eval job's programs join the same cache


def test_on_cpu_the_cache_is_off_unless_asked_for(tmp_path):
  # JAX's CPU collectives can crash with the cache on (kfac-jax's autoencoder).
  log = toy(tmp_path)
  assert "Compilation cache" not in log
  assert not (tmp_path / "compilation_cache").exists()


def test_off_cpu_the_cache_defaults_to_the_checkpoint_dir(tmp_path, monkeypatch):
  monkeypatch.setattr(persistent_cache, "_users_cache_dir", lambda: None)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  config = base_config.get_base_config()
  config.checkpoint_dir = str(tmp_path)
  assert persistent_cache.compilation_cache_dir(config)[0] == str(tmp_path / "compilation_cache")


def test_cache_can_be_moved_and_turned_off(tmp_path):
  toy(tmp_path / "run", f"--config.compilation_cache_dir={tmp_path / 'elsewhere'}")
  assert os.listdir(tmp_path / "elsewhere")
  assert not (tmp_path / "run" / "compilation_cache").exists()
  log = toy(tmp_path / "off", "--config.compilation_cache_dir=")
  assert "Compilation cache" not in log
  assert not (tmp_path / "off" / "compilation_cache").exists()


def test_the_cache_jax_was_given_is_kept_unless_the_config_turns_it_off(tmp_path):
  # A cluster's shared cache, set for JAX in the environment, outranks the per-run default.
  env = dict(ENV, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "shared"))
  log = toy(tmp_path / "run", env=env)
  assert f"Compilation cache: {tmp_path / 'shared'}" in log
  assert os.listdir(tmp_path / "shared")
  assert not (tmp_path / "run" / "compilation_cache").exists()
  shutil.rmtree(tmp_path / "shared")
  log = toy(tmp_path / "off", "--config.compilation_cache_dir=", env=env)
  assert "Compilation cache" not in log
  assert not (tmp_path / "shared").exists()


@pytest.fixture
def session_cache():
  """Gives the suite's shared cache back to JAX after a test that moved it."""
  given = jax.config.jax_compilation_cache_dir
  yield
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", given)
  persistent_cache._previous_cache.update(path=None, users=False)  # pylint: disable=protected-access


def test_each_run_in_one_program_uses_its_own_cache(tmp_path, session_cache):
  del session_cache
  jax.jit(lambda x: x - 1.0)(1.0)  # JAX opens its cache at the first compilation.
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))  # As a user's code may.

  def run(key, checkpoint_dir, value):
    config = base_config.get_base_config()
    config.checkpoint_dir, config.compilation_cache_dir = str(tmp_path / checkpoint_dir), key
    persistent_cache.enable_compilation_cache(config)
    jax.jit(lambda x: x * value)(1.0).block_until_ready()  # A program no run compiled before.

  run(None, "a", 2.0)
  run(None, "b", 3.0)  # A later run, and the user's cache is still the one.
  run(str(tmp_path / "elsewhere"), "c", 4.0)
  run("", "d", 5.0)
  assert len(os.listdir(tmp_path / "users")) == 2
  assert len(os.listdir(tmp_path / "elsewhere")) == 1
  assert not any((tmp_path / name / "compilation_cache").exists() for name in "abcd")
