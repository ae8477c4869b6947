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
  assert f"tensorboard --logdir {tmp_path}" in text


def test_summary_of_a_directory_without_a_run_fails_in_one_line(tmp_path, capsys):
  assert summary.main(["summary", str(tmp_path)]) == 1
  assert "no jaxline_ng run" in capsys.readouterr().err
