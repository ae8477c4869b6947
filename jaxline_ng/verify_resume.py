"""Checks that a run resumed after a preemption is the run that was not interrupted, bit for bit.

    python -m jaxline_ng.verify_resume [--steps=N] [--interrupt_at=K] -- COMMAND...

COMMAND (a run's command line, or a `jaxline_ng.launch` one) runs three times
with disk checkpoints in `--workdir`: uninterrupted to step N; stopped after
step K as a preemption stops it; and that run resumed to N. The final
checkpoints are compared bit for bit entry by entry, and the metrics rows after
K (but the run's config, clock and `steps_per_sec`). Prints `exact` and exits
0; names the first difference and exits 1; exits 2 when a run fails.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

from jaxline_ng import disk_checkpointing, iterator_state, preemption

EXACT, DIFFERENT, CANNOT_VERIFY = 0, 1, 2
# Snapshot entries that differ between two runs of one command by design.
_NOT_COMPARED = frozenset(("run_config", "periodic_action_times"))
# Metrics that measure time, not training.
_TIMING_METRICS = frozenset(("steps_per_sec",))
_ERROR_LINES = 5


class _RunFailed(Exception):
  """A run of COMMAND ended otherwise than expected; the message says how."""


def _overrides(checkpoint_dir: str, steps: int) -> list[str]:
  """What every run gets after COMMAND: saves only at the end and on a stop, a row every step."""
  return [f"--config.checkpoint_dir={checkpoint_dir}", "--config.checkpointer=disk",
          f"--config.training_steps={steps}", "--config.save_checkpoint_interval=0",
          "--config.log_train_data_interval=1", "--config.logging_interval_type=steps"]


def _run(name: str, command: list[str], checkpoint_dir: str, steps: int, expected_code: int,
         stop_after: int | None = None) -> float:
  """Runs COMMAND for `name` (its output to `<checkpoint_dir>/<name>.log`); returns its seconds."""
  env = dict(os.environ)
  env.pop(preemption.STOP_AFTER_STEP_ENV, None)
  if stop_after is not None:
    env[preemption.STOP_AFTER_STEP_ENV] = str(stop_after)
  os.makedirs(checkpoint_dir, exist_ok=True)
  log_path = os.path.join(checkpoint_dir, f"{name.replace(' ', '_')}.log")
  started = time.monotonic()
  with open(log_path, "w") as log:
    try:
      code = subprocess.run([*command, *_overrides(checkpoint_dir, steps)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    except OSError as e:
      raise _RunFailed(f"the {name} run could not start: {e}") from None
  seconds = time.monotonic() - started
  if code != expected_code:
    with open(log_path, errors="replace") as log:
      tail = [line.rstrip() for line in log if line.strip()][-_ERROR_LINES:]
    expected = ("exit 75 (stopped after step "
                f"{stop_after}: does its training loop call its periodic actions?)"
                if expected_code == preemption.EXIT_PREEMPTED else f"exit {expected_code}")
    raise _RunFailed(f"the {name} run exited {code}, expected {expected}; the end of its "
                     f"output ({log_path}):\n  " + "\n  ".join(tail))
  print(f"verify_resume: {name} run: exit {code} ({seconds:.1f} s)", flush=True)
  return seconds


def _leaves(nest: dict[str, Any]) -> dict[str, Any]:
  """A snapshot's compared values by entry name: the loop's entries, then the experiment's."""
  named = {}
  module = nest.get("experiment_module") or {}
  tops = [(name, value) for name, value in nest.items()
          if name != "experiment_module" and name not in _NOT_COMPARED]
  entries = [*sorted(tops), *sorted((f"experiment_module/{k}", v) for k, v in module.items())]
  for name, value in entries:
    if isinstance(value, iterator_state.Position):
      named[name] = value
      continue
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
      named[name + jax.tree_util.keystr(path)] = leaf
  return named


def _difference(a: Any, b: Any) -> str | None:
  """How value `b` differs from `a`, bit for bit; None if it does not."""
  if isinstance(a, iterator_state.Position) or isinstance(b, iterator_state.Position):
    if not (isinstance(a, iterator_state.Position) and isinstance(b, iterator_state.Position)):
      return f"{type(a).__name__} vs {type(b).__name__}"
    if a.to_json() == b.to_json():
      return None
    differing = sorted(p for p in {*a.states, *b.states} if a.states.get(p) != b.states.get(p))
    return (f"iterator position of process {differing[0]}: "
            f"{json.dumps(a.states.get(differing[0]))[:200]} vs "
            f"{json.dumps(b.states.get(differing[0]))[:200]}")
  if jax.dtypes.issubdtype(getattr(a, "dtype", np.float32), jax.dtypes.prng_key):
    a, b = jax.random.key_data(a), jax.random.key_data(b)
  if isinstance(a, (np.ndarray, np.generic, jax.Array)):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
      return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.tobytes() == b.tobytes():
      return None
    unequal = a != b if a.shape else np.asarray([a != b])
    count = int(np.count_nonzero(unequal)) or a.size  # Bits differ where values compare equal.
    text = f"{count} of {a.size} values differ"
    if np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer):
      gap = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))
      text += f" (largest difference {gap:.3g})"
    return text
  if type(a) is not type(b) or a != b:
    return f"{a!r:.60} vs {b!r:.60}"
  return None


def compare_checkpoints(reference_dir: str, resumed_dir: str) -> str | None:
  """The first difference between two runs' newest `latest` checkpoints, as
  "<entry>: <how>", or None when they are equal bit for bit."""
  step_a, nest_a = disk_checkpointing.read(reference_dir)
  step_b, nest_b = disk_checkpointing.read(resumed_dir)
  if step_a != step_b:
    return f"global_step: {step_a} vs {step_b}"
  leaves_a, leaves_b = _leaves(nest_a), _leaves(nest_b)
  for name in [*leaves_a, *(n for n in leaves_b if n not in leaves_a)]:
    if name not in leaves_a or name not in leaves_b:
      return f"{name}: only in the {'resumed' if name in leaves_b else 'uninterrupted'} run"
    how = _difference(leaves_a[name], leaves_b[name])
    if how is not None:
      return f"{name}: {how}"
  return None


def _metrics(checkpoint_dir: str, after: int) -> dict[int, dict[str, Any]]:
  path = os.path.join(checkpoint_dir, "train", "metrics.jsonl")
  rows = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        row = json.loads(line)
        if row["step"] > after:
          rows[row["step"]] = {k: v for k, v in row.items() if k not in _TIMING_METRICS}
  return rows


def _same_number(a: Any, b: Any) -> bool:
  both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
  return both_nan or (type(a) is type(b) and a == b)


def compare_metrics(reference_dir: str, resumed_dir: str, after: int) -> str | None:
  """The first step after `after` whose metrics rows differ, as "step <s>: <how>", or None."""
  rows_a, rows_b = _metrics(reference_dir, after), _metrics(resumed_dir, after)
  for step in sorted({*rows_a, *rows_b}):
    a, b = rows_a.get(step), rows_b.get(step)
    if a is None or b is None:
      return f"step {step}: a row only in the {'resumed' if a is None else 'uninterrupted'} run"
    for key in sorted({*a, *b}):
      if key not in a or key not in b or not _same_number(a[key], b[key]):
        return f"step {step}: {key} {a.get(key)!r} vs {b.get(key)!r}"
  return None


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  if "--" not in argv:
    raise SystemExit("verify_resume: error: give the run's command after --: "
                     "python -m jaxline_ng.verify_resume [--steps=N] [--interrupt_at=K] -- "
                     "python experiment.py --config=...")
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="python -m jaxline_ng.verify_resume",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=20, help="steps the runs train (N)")
  parser.add_argument("--interrupt_at", type=int, default=None,
                      help="the step the interrupted run stops after (K); default N // 2")
  parser.add_argument("--workdir", default="",
                      help="where the runs' directories go (kept); default a temporary one, "
                      "removed when the resume is exact")
  args = parser.parse_args(argv[:split])
  command = argv[split + 1:]
  if args.interrupt_at is None:
    args.interrupt_at = args.steps // 2
  if not command:
    parser.error("no command after --")
  if args.steps < 2:
    parser.error(f"--steps={args.steps}: need 2 or more")
  if not 1 <= args.interrupt_at < args.steps:
    parser.error(f"--interrupt_at={args.interrupt_at}: must be from 1 to --steps - 1 "
                 f"({args.steps - 1})")
  if args.workdir and os.path.exists(args.workdir) and os.listdir(args.workdir):
    parser.error(f"--workdir={args.workdir}: not empty (its checkpoints would be resumed)")
  return args, command


def main(argv: list[str]) -> int:
  """Runs the check; returns the exit code (0 exact, 1 different, 2 cannot verify)."""
  args, command = _parse(argv)
  workdir = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(
      prefix="verify_resume_")
  uninterrupted, interrupted = (os.path.join(workdir, name)
                                for name in ("uninterrupted", "interrupted"))
  started = time.monotonic()
  try:
    runs = _run("uninterrupted", command, uninterrupted, args.steps, 0)
    runs += _run("interrupted", command, interrupted, args.steps, preemption.EXIT_PREEMPTED,
                 stop_after=args.interrupt_at)
    runs += _run("resumed", command, interrupted, args.steps, 0)
  except _RunFailed as e:
    print(f"verify_resume: {e}\n(runs kept in {workdir})", file=sys.stderr)
    return CANNOT_VERIFY
  try:
    difference = compare_checkpoints(uninterrupted, interrupted)
  except (FileNotFoundError, disk_checkpointing.UnusableCheckpoint) as e:
    print(f"verify_resume: cannot read a final checkpoint: {e}\n(runs kept in {workdir})",
          file=sys.stderr)
    return CANNOT_VERIFY
  metrics = compare_metrics(uninterrupted, interrupted, args.interrupt_at)
  print(f"verify_resume: compared in {time.monotonic() - started - runs:.1f} s", flush=True)
  if difference is None and metrics is None:
    print("exact")
    if not args.workdir:
      shutil.rmtree(workdir, ignore_errors=True)
    return EXACT
  if difference is not None:
    print(f"differs: {difference}")
  if metrics is not None:
    print(f"{'first differing metrics' if difference else 'differs: metrics'}: {metrics}")
  else:
    print(f"metrics of the steps after {args.interrupt_at}: equal")
  print(f"(runs kept in {workdir})")
  return DIFFERENT


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
