"""python -m jaxline_ng.summary: reading a run directory without TensorFlow."""

import json

from jaxline_ng import summary


def write_jsonl(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_names_logs_checkpoints_and_best_metric(tmp_path):
  write_jsonl(tmp_path / "train" / "metrics.jsonl", [{"step": 10, "loss": 0.5}])
  (tmp_path / "train" / "run.json").write_text(json.dumps({"config": {
      "best_model_eval_metric": "acc", "best_model_eval_metric_higher_is_better": True}}))
  write_jsonl(tmp_path / "eval" / "metrics.jsonl",
              [{"step": 5, "acc": 0.9}, {"step": 10, "acc": float("nan")},
               {"step": 15, "acc": 0.95}, {"step": 20, "acc": 0.93}])
  (tmp_path / "checkpoints" / "latest" / "20").mkdir(parents=True)
  (tmp_path / "checkpoints" / "latest" / "20.orbax-checkpoint-tmp-1").mkdir()
  text = "\n".join(summary.summarize(str(tmp_path)))
  assert "Best acc: 0.9500 at step 15" in text
  assert "Checkpoints (latest): steps [20]" in text
  assert "train: 1 logged steps, last step 10: loss=0.5" in text
  assert "tensorboard" not in text  # No event files, nothing to show.
  (tmp_path / "eval" / "events.out.tfevents.1.host").write_bytes(b"")
  assert f"TensorBoard: tensorboard --logdir {tmp_path}" in summary.summarize(str(tmp_path))


def test_summary_of_a_directory_without_a_run_fails_in_one_line(tmp_path, capsys):
  assert summary.main(["summary", str(tmp_path)]) == 1
  assert "no jaxline_ng run" in capsys.readouterr().err


def test_summary_of_a_run_killed_mid_write_skips_its_torn_last_row(tmp_path, capsys):
  write_jsonl(tmp_path / "train" / "metrics.jsonl", [{"step": 10, "loss": 0.5}])
  with open(tmp_path / "train" / "metrics.jsonl", "a") as f:
    f.write('{"step": 20, "lo')  # What kill -9 mid-write leaves.
  assert "train: 1 logged steps, last step 10" in "\n".join(summary.summarize(str(tmp_path)))
  with open(tmp_path / "train" / "metrics.jsonl", "ab") as f:
    f.write('ss_µ'.encode()[:-1])  # Torn inside a character: not UTF-8.
  assert "train: 1 logged steps, last step 10" in "\n".join(summary.summarize(str(tmp_path)))
  (tmp_path / "eval" / "metrics.jsonl").parent.mkdir()
  (tmp_path / "eval" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
  assert summary.main(["summary", str(tmp_path)]) == 1
  assert f"{tmp_path / 'eval' / 'metrics.jsonl'}, line 2: " in capsys.readouterr().err


def test_summary_gives_each_evaluator_its_own_best(tmp_path):
  (tmp_path / "train").mkdir()
  (tmp_path / "train" / "run.json").write_text(json.dumps({"config": {
      "best_model_eval_metric": "acc", "best_model_eval_metric_higher_is_better": True}}))
  write_jsonl(tmp_path / "train" / "metrics.jsonl", [{"step": 10, "loss": 0.5}])
  write_jsonl(tmp_path / "eval_train" / "metrics.jsonl", [{"step": 10, "acc": 0.99}])
  write_jsonl(tmp_path / "eval_heldout" / "metrics.jsonl", [{"step": 10, "acc": 0.7}])
  text = "\n".join(summary.summarize(str(tmp_path)))
  assert "Best acc (eval_heldout): 0.7000 at step 10" in text
  assert "Best acc (eval_train): 0.9900 at step 10" in text


def test_summary_names_a_damaged_file_in_one_line_and_skips_a_users_own(tmp_path, capsys):
  write_jsonl(tmp_path / "train" / "metrics.jsonl", [{"step": 10, "loss": 0.5}])
  (tmp_path / "checkpoints" / "latest" / "10").mkdir(parents=True)
  (tmp_path / "checkpoints" / "NOTES.txt").write_text("lr sweep, run 3")
  assert "Checkpoints (latest): steps [10]" in "\n".join(summary.summarize(str(tmp_path)))
  record = tmp_path / "train" / "run.json"
  for damaged in ('{"config": {"best_mo', "[1, 2]"):
    record.write_text(damaged)
    assert summary.main(["summary", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"jaxline_ng.summary: error: {record}: ")
  record.unlink()
  for row in ("[1, 2]", '{"loss": 0.5}'):
    (tmp_path / "train" / "metrics.jsonl").write_text(row + "\n")
    assert summary.main(["summary", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"jaxline_ng.summary: error: {tmp_path}/train/metrics.jsonl"
                                       ", line 1: not a metrics row (an object with a step)\n")
