"""Whether saves can write under a checkpoint_dir (checked before training, not at the
first save), and the error when a write fails."""

import errno
import os
import re

from jaxline_ng import base_config, errors


class CheckpointWriteError(OSError, errors.OneLineError):
  """The filesystem refused a save (full, read-only, gone); names the directory."""


# How TensorStore, which writes orbax's arrays, names the OS error behind a
# failed write in the ValueError it raises: "... [os_error_code='28']".
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def os_error_code(error: Exception) -> int | None:
  """The errno behind a failed save: an OSError's, or the one TensorStore's message names."""
  if isinstance(error, OSError):
    return error.errno
  found = _OS_ERROR_CODE.search(str(error))
  return int(found.group(1)) if found else None


def _existing_ancestor(path: str) -> str:
  """`path`, or the nearest directory above it that exists."""
  while not os.path.lexists(path := os.path.abspath(path)):
    path = os.path.dirname(path)
  return path


def check_writable(path: str) -> None:
  """Raises CheckpointWriteError if saves could not create or write `path`."""
  existing = _existing_ancestor(path)
  if not os.path.isdir(existing):
    raise CheckpointWriteError(errno.ENOTDIR, f"cannot save checkpoints in {path}: {existing} "
                               "is not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise CheckpointWriteError(errno.EACCES, f"cannot save checkpoints in {path}: {existing} "
                               "is not writable")


# The longest path a save writes below checkpoint_dir, with room to spare:
# checkpoints/process_<i>/best_<name>/<step>.orbax-checkpoint-tmp-<time>/state/
# ocdbt.process_<i>/d/<32 hex digits> is some 150 characters.
_LONGEST_PATH_BELOW = 200


def check_checkpoint_dir(checkpoint_dir: str) -> None:
  """Raises ConfigError if orbax could not save under `checkpoint_dir`, or read back."""
  existing = _existing_ancestor(checkpoint_dir)
  try:
    path_max = os.pathconf(existing, "PC_PATH_MAX")
  except (OSError, ValueError):  # No limit known here.
    path_max = None
  longest = len(os.fsencode(os.path.abspath(checkpoint_dir))) + _LONGEST_PATH_BELOW
  if path_max is not None and longest >= path_max:
    raise base_config.ConfigError(
        f"config.checkpoint_dir={checkpoint_dir[:40]!r}... is {len(checkpoint_dir)} "
        f"characters long: the checkpoints' paths below it would reach about {longest}, "
        f"beyond this filesystem's limit of {path_max} (PC_PATH_MAX): choose a shorter path")
  if re.search(r"\[.*\]", checkpoint_dir):  # Orbax's glob of a save's files would find none.
    raise base_config.ConfigError(
        f"config.checkpoint_dir={checkpoint_dir!r}: orbax cannot save under a path holding "
        "'[...]' (it takes it for a glob pattern): choose one without brackets")
  if "\\" in checkpoint_dir:
    # TensorStore, which writes orbax's arrays, takes a backslash for a path
    # separator: `run\x`'s arrays went to `run/x`, and its checkpoints,
    # committed without them, could not be restored.
    raise base_config.ConfigError(
        f"config.checkpoint_dir={checkpoint_dir!r}: orbax cannot save under a path holding a "
        "backslash (its array store takes it for '/'): choose one without")
