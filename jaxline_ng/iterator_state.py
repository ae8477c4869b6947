"""Data iterators in checkpoints: each process's position, saved and set back.

A checkpointed attribute may hold an iterator with `get_state()`/`set_state()`
(grain's protocol, NumPy's `RandomState`) or a `tf.data` iterator. A checkpoint
holds its `Position`, every process's state as JSON by process index; in a
multi-process run the others hand theirs to the chief's saves (`PeerPositions`).
"""

import base64
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from jaxline_ng import agreement, base_config, distributed, errors

GET_STATE, TF_DATA = "get_state", "tf.data"
# Marks a JSON object that stands for a value JSON has no type for.
_TAG = "__jaxline_ng__"


class IteratorStateError(TypeError, errors.OneLineError):
  """An iterator position that cannot be saved or set back; names the entry."""


def kind_of(value: Any) -> str | None:
  """How `value`'s position is saved (`GET_STATE`, `TF_DATA`), or None if it is no such iterator."""
  # Only a program that made a tf.data iterator imported TensorFlow (and did so
  # completely: the writer may be importing it on another thread meanwhile).
  tf_iterator = getattr(getattr(sys.modules.get("tensorflow"), "data", None), "Iterator", None)
  if isinstance(tf_iterator, type) and isinstance(value, tf_iterator):
    return TF_DATA
  if not isinstance(value, type) and callable(getattr(value, "get_state", None)) and callable(
      getattr(value, "set_state", None)):
    return GET_STATE
  return None


@dataclasses.dataclass(frozen=True)
class Position:
  """What a checkpoint holds for an iterator: each process's state (JSON), by process index."""
  kind: str
  states: Mapping[int, Any]

  def to_json(self) -> str:
    return json.dumps({"kind": self.kind, "states": {str(p): s for p, s in self.states.items()}},
                      sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "Position":
    data = json.loads(text)
    return cls(data["kind"], {int(p): s for p, s in data["states"].items()})

  def with_states(self, states: Mapping[int, Any]) -> "Position":
    return Position(self.kind, {**self.states, **states})


def capture(value: Any, name: str) -> Position:
  """This process's position of iterator `value` (checkpoint entry `name`)."""
  kind = kind_of(value)
  state = _tf_data_state(value) if kind == TF_DATA else value.get_state()
  try:
    encoded = _encode(state)
  except TypeError as e:
    raise IteratorStateError(f"cannot checkpoint {name}: its get_state() returned {e}; a state "
                             "is made of plain values, bytes, lists, tuples, dicts and NumPy "
                             "arrays") from None
  return Position(kind, {jax.process_index(): encoded})


def set_back(live: Any, saved: Position, name: str) -> None:
  """Sets this process's saved state into `live`, the iterator the experiment built."""
  kind = kind_of(live)
  if kind != saved.kind:
    what = "no iterator" if kind is None else f"a {kind} iterator"
    raise IteratorStateError(
        f"checkpoint entry {name} holds a {saved.kind} iterator's position, but the experiment "
        f"holds {what} ({type(live).__name__}) there")
  me = jax.process_index()
  if me not in saved.states:
    raise IteratorStateError(
        f"checkpoint entry {name} holds the positions of processes {sorted(saved.states)}, none "
        f"for process {me}: resume with the process count that saved it")
  state = _decode(saved.states[me])
  if kind == TF_DATA:
    _set_tf_data_state(live, state)
  else:
    live.set_state(state)


def restore_attribute(experiment: Any, attr: str, saved: Position, name: str) -> None:
  """Sets the position saved for `name` into `experiment.<attr>`; an experiment
  that holds None there (an evaluator that builds no training data) keeps None."""
  live = getattr(experiment, attr, None)
  if live is None:
    logging.warning("[jaxline_ng] Checkpoint entry %s (an iterator's position) is not restored: "
                    "the experiment holds None there (build the iterator in __init__).", name)
    return
  set_back(live, saved, name)


def _checkpoint_attrs(experiment: Any) -> dict[str, str]:
  return {**(getattr(experiment, "CHECKPOINT_ATTRS", None) or {}),
          **(getattr(experiment, "NON_BROADCAST_CHECKPOINT_ATTRS", None) or {})}


def saveable_names(experiment: Any) -> list[str]:
  """The checkpoint names of the experiment's attributes that hold saveable iterators."""
  return sorted(name for attr, name in _checkpoint_attrs(experiment).items()
                if kind_of(getattr(experiment, attr, None)) is not None)


def _tf_data_state(iterator: Any) -> dict[str, bytes]:
  """A tf.data iterator's checkpoint files (`tf.train.Checkpoint`), by name."""
  tf = sys.modules["tensorflow"]
  with tempfile.TemporaryDirectory() as directory:
    tf.train.Checkpoint(iterator=iterator).write(os.path.join(directory, "iterator"))
    files = {}
    for file_name in sorted(os.listdir(directory)):
      with open(os.path.join(directory, file_name), "rb") as f:
        files[file_name] = f.read()
  return files


def _set_tf_data_state(iterator: Any, files: dict[str, bytes]) -> None:
  tf = sys.modules["tensorflow"]
  with tempfile.TemporaryDirectory() as directory:
    for file_name, data in files.items():
      with open(os.path.join(directory, os.path.basename(file_name)), "wb") as f:
        f.write(data)
    tf.train.Checkpoint(iterator=iterator).read(
        os.path.join(directory, "iterator")).assert_existing_objects_matched()


def _encode(x: Any) -> Any:
  """`x` as JSON-able values; raises TypeError naming a type it cannot hold."""
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  if isinstance(x, bytes):
    return {_TAG: "bytes", "data": base64.b64encode(x).decode()}
  if isinstance(x, (np.ndarray, np.generic)):
    array = np.asarray(x)
    if array.dtype == object:
      raise TypeError("a NumPy array of Python objects")
    return {_TAG: "ndarray" if isinstance(x, np.ndarray) else "numpy_scalar",
            "dtype": array.dtype.str, "shape": list(array.shape),
            "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()}
  if type(x) is list:
    return [_encode(v) for v in x]
  if type(x) is tuple:
    return {_TAG: "tuple", "items": [_encode(v) for v in x]}
  if isinstance(x, dict):
    if all(isinstance(k, str) for k in x) and _TAG not in x:
      return {k: _encode(v) for k, v in x.items()}
    return {_TAG: "dict", "items": [[_encode(k), _encode(v)] for k, v in x.items()]}
  raise TypeError(f"a {type(x).__name__}")


def _decode(x: Any) -> Any:
  if isinstance(x, list):
    return [_decode(v) for v in x]
  if not isinstance(x, dict):
    return x
  tag = x.get(_TAG)
  if tag is None:
    return {k: _decode(v) for k, v in x.items()}
  if tag == "bytes":
    return base64.b64decode(x["data"])
  if tag in ("ndarray", "numpy_scalar"):
    array = np.frombuffer(base64.b64decode(x["data"]), np.dtype(x["dtype"])).reshape(x["shape"])
    return array.copy() if tag == "ndarray" else array[()]
  if tag == "tuple":
    return tuple(_decode(v) for v in x["items"])
  return {_decode(k): _decode(v) for k, v in x["items"]}


class PeerPositions:
  """A multi-process run's iterators: at the steps the chief saves, which every
  process knows, the others publish their positions (`at_save`) for it to `gather`."""

  def __init__(self, config, experiment: Any):
    self.names = saveable_names(experiment)
    interval_type = config.checkpoint_interval_type or config.interval_type
    if self.names and config.save_checkpoint_interval > 0 and interval_type != "steps":
      raise base_config.ConfigError(
          f"checkpoint entries {', '.join(self.names)} hold each process's data position, which "
          "the processes save at steps they all know: set config.checkpoint_interval_type="
          f"'steps' (it is {interval_type!r}), or save_checkpoint_interval=0 (only at the end "
          "and on a stop)")

  def at_save(self, experiment: Any, step: int) -> None:
    """Publishes this process's positions at `step` (processes other than the chief)."""
    now = saveable_names(experiment)
    if now != self.names:
      raise IteratorStateError(
          f"checkpoint entries {', '.join(sorted(set(now) ^ set(self.names)))} became saveable "
          "iterators after training started: build them in __init__, so that every process "
          "saves their positions from the first checkpoint on")
    if distributed.is_chief() or not self.names:
      return
    states = {name: capture(getattr(experiment, attr), f"experiment_module/{name}")
              .states[jax.process_index()]
              for attr, name in _checkpoint_attrs(experiment).items() if name in self.names}
    agreement.exchange(f"iterator_positions/{step}", json.dumps(states), read_from=())


def gather(positions: dict[str, Position], step: int) -> dict[str, Position]:
  """`positions` (the chief's, by entry name) with every other process's states at `step`.

  Raises IteratorStateError once another process has published a failure.
  """
  gathered = dict(positions)
  for process in range(jax.process_count()):
    if process == jax.process_index():
      continue
    published = agreement.exchange(f"iterator_positions/{step}", None, read_from=[process])
    if published is None:
      raise IteratorStateError(f"not saving step {step}: process {process} failed before "
                               "handing over its data positions")
    states = json.loads(published[0])
    for name in positions:
      short = name.split("/", 1)[-1]
      if short not in states:
        raise IteratorStateError(f"process {process} saved no position for {name} at step "
                                 f"{step}: it holds no saveable iterator there")
      gathered[name] = gathered[name].with_states({process: states[short]})
  return gathered
