"""Summarises a run from its directory, without TensorFlow or JAX.

    python -m jaxline_ng.summary /tmp/my_run

Prints where the logs and checkpoints are, the last step logged per mode and
each evaluator's best `best_model_eval_metric`; exits non-zero with one line
when the directory holds no run.
"""

import json
import math
import os
import sys
from typing import Any


class SummaryError(ValueError):
  """A metrics file or run record that does not parse; names the file (and line)."""


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  """The rows of a metrics file; a torn last line (a run killed mid-write) is left out."""
  with open(path, "rb") as f:  # Bytes: a write torn inside a character is not UTF-8.
    lines = f.readlines()
  rows = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except ValueError as e:  # Not JSON, or not UTF-8.
      if number == len(lines) and not line.endswith(b"\n"):
        break
      raise SummaryError(f"{path}, line {number}: {e}") from None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
      raise SummaryError(f"{path}, line {number}: not a metrics row (an object with a step)")
    rows.append(row)
  return rows


def _read_config(path: str) -> dict[str, Any]:
  """The config a run record holds."""
  try:
    with open(path) as f:
      record = json.load(f)
  except ValueError as e:  # Damaged: not JSON, or not UTF-8.
    raise SummaryError(f"{path}: {e}") from None
  if not isinstance(record, dict) or not isinstance(record.get("config", {}), dict):
    raise SummaryError(f"{path}: not a jaxline_ng run record")
  return record.get("config", {})


def summarize(checkpoint_dir: str) -> list[str]:
  """The summary's lines; raises FileNotFoundError if there is no run there."""
  modes = sorted(name for name in os.listdir(checkpoint_dir)
                 if os.path.isfile(os.path.join(checkpoint_dir, name, "metrics.jsonl"))) \
      if os.path.isdir(checkpoint_dir) else []
  if not modes:
    raise FileNotFoundError(f"{checkpoint_dir}: no <mode>/metrics.jsonl, so no jaxline_ng run")
  lines = [f"Run directory: {os.path.abspath(checkpoint_dir)}"]
  config = {}
  records_of = {}
  for mode in modes:
    record_path = os.path.join(checkpoint_dir, mode, "run.json")
    if not config and os.path.isfile(record_path):
      config = _read_config(record_path)
    records = records_of[mode] = _read_jsonl(os.path.join(checkpoint_dir, mode, "metrics.jsonl"))
    last = records[-1] if records else {}
    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in sorted(last.items()) if k != "step")
    lines.append(f"  {mode}: {len(records)} logged steps, last step {last.get('step')}: {shown}")
    lines.append(f"    {os.path.join(checkpoint_dir, mode, 'metrics.jsonl')}")

  metric = config.get("best_model_eval_metric")
  if metric:
    higher = config.get("best_model_eval_metric_higher_is_better", True)
    # Each evaluator has its own best: eval_<name> modes evaluate other data.
    evaluators = [mode for mode in modes if mode.startswith("eval")]
    for mode in evaluators:
      finite = [r for r in records_of[mode]
                if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]
      if finite:
        best = (max if higher else min)(finite, key=lambda r: r[metric])
        of_mode = f" ({mode})" if len(evaluators) > 1 else ""
        lines.append(f"Best {metric}{of_mode}: {best[metric]:.4f} at step {best['step']}")

  checkpoints = os.path.join(checkpoint_dir, "checkpoints")
  if os.path.isdir(checkpoints):
    for series in sorted(os.listdir(checkpoints)):
      if not os.path.isdir(os.path.join(checkpoints, series)):
        continue  # A file of the user's (notes), as training leaves it.
      steps = sorted(int(n) for n in os.listdir(os.path.join(checkpoints, series)) if n.isdigit())
      if steps:
        lines.append(f"Checkpoints ({series}): steps {steps} in "
                     f"{os.path.join(checkpoints, series)}")
  if any(name.startswith("events.out.tfevents.")
         for mode in modes for name in os.listdir(os.path.join(checkpoint_dir, mode))):
    lines.append(f"TensorBoard: tensorboard --logdir {checkpoint_dir}")
  return lines


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print("usage: python -m jaxline_ng.summary CHECKPOINT_DIR", file=sys.stderr)
    return 2
  try:
    lines = summarize(argv[1])
  except (FileNotFoundError, NotADirectoryError, SummaryError) as e:
    print(f"jaxline_ng.summary: error: {e}", file=sys.stderr)
    return 1
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
