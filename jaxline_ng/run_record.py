"""What a run was: `<checkpoint_dir>/<mode>/run.json`, and config drift on resume.

The record holds the resolved config, command line, versions, devices and
git commit. Each checkpoint carries its flattened config, so a resumed run
says which keys differ (or refuses, with `config.strict_resume_config`).
"""

import datetime
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jaxlib
import ml_collections

import jaxline_ng

# An object's default repr holds its address, which differs in every process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Where a run lives and how strictly it compares are not what it computes.
_NOT_COMPARED = frozenset(("checkpoint_dir", "compilation_cache_dir", "strict_resume_config"))


def flat_config(config) -> dict[str, Any]:
  """The config as `{"dotted.key": value}`, values made JSON-safe (repr otherwise)."""
  flat = {}

  def visit(prefix: str, node: Any) -> None:
    # Not any object with an `items` attribute (a class, a dataclass field).
    if isinstance(node, (Mapping, ml_collections.ConfigDict)):
      for key, value in node.items():
        visit(f"{prefix}.{key}" if prefix else str(key), value)
      return
    try:
      json.dumps(node)
      flat[prefix] = node
    except (TypeError, ValueError):
      if isinstance(node, (set, frozenset)):  # Its order varies with each process's hash seed.
        node = sorted(node, key=repr)
      flat[prefix] = _ADDRESS.sub("", repr(node))

  visit("", config.to_dict() if hasattr(config, "to_dict") else config)
  return flat


def _git_commit(directory: str) -> dict[str, Any] | None:
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True,
                            text=True, timeout=5)
    if commit.returncode != 0:
      return None
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                            cwd=directory, capture_output=True, text=True, timeout=5)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def record(config, mode: str) -> dict[str, Any]:
  devices = jax.devices()
  kinds: dict[str, int] = {}
  for device in devices:
    kinds[device.device_kind] = kinds.get(device.device_kind, 0) + 1
  return {
      "mode": mode,
      "started": datetime.datetime.now(datetime.UTC).isoformat(),
      "command_line": sys.argv,
      "working_directory": os.getcwd(),
      "git": _git_commit(os.getcwd()),
      "versions": {"jaxline_ng": jaxline_ng.__version__, "jax": jax.__version__,
                   "jaxlib": jaxlib.__version__, "python": sys.version.split()[0]},
      "devices": {"backend": jax.default_backend(), "kinds": kinds,
                  "global_count": len(devices), "local_count": jax.local_device_count()},
      "processes": {"count": jax.process_count(), "index": jax.process_index()},
      "config": flat_config(config),
  }


def write(config, mode: str, logdir: str) -> str:
  """Writes `<logdir>/run.json` and returns its path; an earlier launch's record
  is kept as `run.<its start time>.json` (it may be the one that made the checkpoints)."""
  os.makedirs(logdir, exist_ok=True)
  path = os.path.join(logdir, "run.json")
  if os.path.exists(path):
    try:
      with open(path) as f:
        started = json.load(f)["started"]
    except (OSError, ValueError, KeyError, TypeError):
      started = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.UTC).isoformat()
    os.replace(path, os.path.join(logdir, f"run.{started.replace(':', '')}.json"))
  # Whole or not at all: a run killed as it starts leaves no torn record.
  with open(f"{path}.tmp", "w") as f:
    json.dump(record(config, mode), f, indent=2, sort_keys=True)
  os.replace(f"{path}.tmp", path)
  return path


def same_value(a: Any, b: Any) -> bool:
  """Whether two values of `flat_config` are equal, NaN to NaN too (as JSON writes them)."""
  return json.dumps(a) == json.dumps(b)


# A longer value (a dataclass's repr) is shown around where the two differ.
_LONGEST_SHOWN = 100
_CONTEXT = 30


def _around_difference(before: str, after: str) -> tuple[str, str]:
  if max(len(before), len(after)) <= _LONGEST_SHOWN:
    return before, after
  start = len(os.path.commonprefix([before, after]))
  same_end = min(len(os.path.commonprefix([before[::-1], after[::-1]])),
                 min(len(before), len(after)) - start)

  def cut(text: str) -> str:
    low, high = max(0, start - _CONTEXT), min(len(text), len(text) - same_end + _CONTEXT)
    return ("…" if low else "") + text[low:high] + ("…" if high < len(text) else "")

  return cut(before), cut(after)


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """Lines `key: saved -> current` for every key whose value differs (but the run's location,
  its cache and `strict_resume_config`); long strings are cut to where they differ."""
  lines = []
  for key in sorted((set(saved) | set(current)) - _NOT_COMPARED):
    before, after = saved.get(key, "<absent>"), current.get(key, "<absent>")
    if not same_value(before, after):
      if isinstance(before, str) and isinstance(after, str):
        before, after = _around_difference(before, after)
      lines.append(f"{key}: {before!r} -> {after!r}")
  return lines
