"""From the `--config` flag to the config a run uses: loading errors in one line naming
the file or override, a plain dict accepted, the run's paths made absolute once."""

import os
import re
import sys

import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from jaxline_ng import base_config


def report_errors_in_one_line(config_flag) -> None:
  """Makes config-file failures (a missing file, a syntax error, an override of
  an unknown key) one-line flag errors naming the file or override."""
  # Flags are parsed inside `app.run`, before our code runs, and ml_collections'
  # flag has no hook for its errors: its `_parse` is wrapped.
  parse = config_flag._parse  # pylint: disable=protected-access

  def parse_or_explain(argument: str):
    path = argument.split(":", 1)[0]
    if os.path.isdir(path):
      raise flags.IllegalFlagValueError(f"config file {path!r} is a directory")
    if not os.path.isfile(path):
      raise flags.IllegalFlagValueError(f"config file {path!r} does not exist")
    if not os.access(path, os.R_OK):
      raise flags.IllegalFlagValueError(f"config file {path!r} is not readable")
    try:
      config = parse(argument)
    except flags.Error as e:
      # `get_config(arg)` raising comes back as a flag error holding the traceback.
      if "Traceback (most recent call last)" not in str(e):
        raise
      raise flags.IllegalFlagValueError(
          f"loading {argument!r} failed: {str(e).strip().splitlines()[-1].strip()}") from None
    except SyntaxError as e:
      raise flags.IllegalFlagValueError(
          f"config file {path!r} line {e.lineno}: SyntaxError: {e.msg}") from None
    except (AttributeError, KeyError) as e:
      # ml_collections wraps a KeyError whose message adds a second line with
      # a close match ("Did you mean ...") to the key: the first line is the key.
      cause = e
      while cause.args and isinstance(cause.args[0], BaseException):
        cause = cause.args[0]
      message = str(cause.args[0]) if cause.args else str(cause)
      key = message.splitlines()[0].strip("\"'") if message.strip() else ""
      overrides = [arg.split("=", 1)[0] for arg in sys.argv[1:] if arg.startswith("--config.")]
      override = next((path for path in overrides if key in path.split(".")[1:]), None)
      if "has no attribute 'get_config'" in message:
        raise flags.IllegalFlagValueError(f"config file {path!r} defines no get_config()") from None
      if override is None:  # Raised by the config file's own code.
        raise flags.IllegalFlagValueError(
            f"loading {argument!r} failed: {type(e).__name__}: {e}") from None
      close = re.search(r'Did you mean "([^"]+)"', message)
      hint = f" (did you mean {close.group(1)!r}?)" if close else ""
      raise flags.IllegalFlagValueError(
          f"{override}: the config {path!r} has no key {key!r} there{hint}") from None
    except Exception as e:  # pylint: disable=broad-except  (any failure of user code)
      first_line = str(e).strip().splitlines()[-1] if str(e).strip() else ""
      raise flags.IllegalFlagValueError(
          f"loading {argument!r} failed: {type(e).__name__}: {first_line}") from None
    if config is None:  # ml_collections would only say "--config must have a value".
      raise flags.IllegalFlagValueError(f"get_config() in {path!r} returned None")
    return config

  config_flag._parse = parse_or_explain  # pylint: disable=protected-access


def as_config_dict(config, config_flag) -> ml_collections.ConfigDict:
  """The config as a ConfigDict; a `get_config()` returning a plain dict is converted.

  Args:
    config: what the config file's `get_config()` returned.
    config_flag: the `--config` flag, whose file is named if `config` is
      neither (a config set in code, as tests do with flagsaver, has none).
  """
  if isinstance(config, ml_collections.ConfigDict):
    return config
  if isinstance(config, dict):
    return ml_collections.ConfigDict(config)
  filename = config_flags.get_config_filename(config_flag)
  raise base_config.ConfigError(
      f"config file {filename!r}: get_config() returned a {type(config).__name__}; return an "
      "ml_collections.ConfigDict, e.g. built on jaxline_ng.base_config.get_base_config()")


def make_paths_absolute(config) -> None:
  """Makes `checkpoint_dir` (empty: the working directory, as jaxline's writers),
  `restore_path` and `compilation_cache_dir` absolute, once: orbax refuses relative
  paths, and a later `chdir` would move the run's files."""
  for key in ("checkpoint_dir", "restore_path", "compilation_cache_dir"):
    given = config[key]
    if not given and key != "checkpoint_dir":
      continue
    if isinstance(given, os.PathLike):  # A pathlib.Path, in a config not typed by the base's.
      given = os.fspath(given)
      with config.ignore_type():  # The field was typed Path when the config set it.
        config[key] = given
    if not isinstance(given, str):
      raise base_config.ConfigError(
          f"config.{key}={given!r} is a {type(given).__name__}; give a directory path (a "
          'string; "" for the working directory)' if key == "checkpoint_dir" else
          f"config.{key}={given!r} is a {type(given).__name__}; give a path (a string)")
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", given):  # Python's I/O would make "gs:" a dir.
      raise base_config.ConfigError(
          f"config.{key}={given!r}: jaxline_ng keeps runs on a local or mounted filesystem, "
          "not at a URL: mount the bucket (gcsfuse, s3fs) and give the mount's path")
    absolute = os.path.abspath(os.path.expanduser(given or "."))
    if absolute != given:
      config[key] = absolute
      logging.info("[jaxline_ng] config.%s=%r: using %s.", key, given, absolute)


def warn_if_eval_dir_differs(config) -> None:
  """Published configs set `eval_specific_checkpoint_dir` (a key of later
  jaxline versions), mostly to "" or their checkpoint_dir; evaluators read
  `checkpoint_dir`, so another directory there would go unread unnoticed."""
  eval_dir = config.get("eval_specific_checkpoint_dir")
  if eval_dir and os.path.abspath(os.path.expanduser(eval_dir)) != config.checkpoint_dir:
    logging.warning("[jaxline_ng] config.eval_specific_checkpoint_dir=%r is not read: evaluation "
                    "reads config.checkpoint_dir=%r.", eval_dir, config.checkpoint_dir)
