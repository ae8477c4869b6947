"""JAX's persistent compilation cache: the directory a run uses, and turning it on."""

import os

import jax
from absl import logging
from jax.experimental.compilation_cache import compilation_cache

from jaxline_ng import base_config

# The cache the previous run in this process gave JAX, and whether it was the user's own.
_previous_cache = {"path": None, "users": False}


def _users_cache_dir() -> str | None:
  """The cache the user gave JAX (env or `jax.config.update`), not one an earlier run set."""
  current = jax.config.jax_compilation_cache_dir
  if not current or (current == _previous_cache["path"] and not _previous_cache["users"]):
    return None
  return current


_USERS_CACHE = "JAX's compilation cache directory"


def compilation_cache_dir(config) -> tuple[str | None, str]:
  """`(directory or None for off, what chose it)` for JAX's persistent compilation cache.

  Unset, it is the cache the user gave JAX itself (a cluster's shared cache),
  else `<checkpoint_dir>/compilation_cache` off CPU. What chose it is the
  culprit an error names.
  """
  given = config.compilation_cache_dir
  if given is not None:
    return given or None, f"config.compilation_cache_dir={given!r}"
  users = _users_cache_dir()
  if users:
    return users, _USERS_CACHE
  if jax.default_backend() == "cpu":
    # JAX's CPU collectives can crash with the persistent cache on (under jaxline too).
    return None, "the CPU backend"
  return (os.path.join(config.checkpoint_dir, "compilation_cache"),
          f"config.checkpoint_dir={config.checkpoint_dir!r}")


def enable_compilation_cache(config) -> None:
  """Points JAX's persistent compilation cache at the run's directory (before anything compiles).

  Raises:
    ConfigError: the directory cannot be written (JAX would only warn, at
      every compilation).
  """
  path, chosen_by = compilation_cache_dir(config)
  if path is not None:
    try:
      os.makedirs(path, exist_ok=True)
      if not os.access(path, os.W_OK):
        raise PermissionError("not writable")
    except OSError as e:
      raise base_config.ConfigError(
          f"{chosen_by}: cannot write {path}: {e.strerror or e}") from None
  # JAX opens its cache once, at the first compilation: a later run reopens it.
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", path)
  _previous_cache.update(path=path, users=chosen_by == _USERS_CACHE)
  if path is not None:
    logging.info("[jaxline_ng] Compilation cache: %s", path)
