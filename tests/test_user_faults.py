"""The faults and mistakes a real user makes, run as the user would: real processes.

Each case ends one of two ways: the run goes on correctly, or it stops
within seconds with one line naming the culprit.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(ROOT, "tests", "experiments", "toy.py")
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
           JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


def toy(*args, config=TOY, script=TOY):
  return [sys.executable, script, f"--config={config}", *args]


def run(args, cwd=ROOT, timeout=120):
  return subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_relative_checkpoint_dir_with_disk_checkpoints(tmp_path):
  result = run(toy("--config.checkpoint_dir=runs/x", "--config.checkpointer=disk",
                   "--config.training_steps=10", "--config.save_checkpoint_interval=5"),
               cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  run_dir = tmp_path / "runs" / "x"
  assert sorted(os.listdir(run_dir / "checkpoints" / "latest")) == ["10", "5"]
  assert read_jsonl(run_dir / "train" / "metrics.jsonl")[-1]["step"] == 10
  with open(run_dir / "train" / "run.json") as f:
    assert json.load(f)["config"]["checkpoint_dir"] == str(run_dir)


def test_override_one_letter_off_a_key_is_one_line_with_a_hint(tmp_path):
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.training_step=5"),
               timeout=60)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  lines = [l for l in result.stderr.splitlines() if "--config.training_step:" in l]
  assert len(lines) == 1, result.stderr[-2000:]
  assert "has no key 'training_step' there (did you mean 'training_steps'?)" in lines[0]
  assert "Did you mean" not in result.stderr


def test_get_config_returning_a_plain_dict_is_accepted(tmp_path):
  config_file = tmp_path / "dict_config.py"
  config_file.write_text(
      "from jaxline_ng import base_config\n"
      "def get_config():\n"
      "  config = base_config.get_base_config().to_dict()\n"
      "  config.update(training_steps=4, interval_type='steps', log_train_data_interval=2,\n"
      "                experiment_kwargs={'config': {'learning_rate': 0.1, 'dim': 3,\n"
      "                                              'fail_at_step': -1, 'fail_on_process': -1,\n"
      "                                              'record_keys_dir': ''}})\n"
      "  return config\n")
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.training_steps=6",
                   config=str(config_file)))
  assert result.returncode == 0, result.stderr[-3000:]
  assert [r["step"] for r in read_jsonl(tmp_path / "train" / "metrics.jsonl")] == [2, 4, 6]


def test_get_config_returning_something_else_names_the_config_file(tmp_path):
  config_file = tmp_path / "list_config.py"
  config_file.write_text("def get_config():\n  return [1, 2]\n")
  result = run(toy(config=str(config_file)), timeout=60)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  assert f"config file '{config_file}': get_config() returned a list" in result.stderr
