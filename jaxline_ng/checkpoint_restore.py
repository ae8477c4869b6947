"""Reading and checking a step directory.

Restoring executes nothing from the checkpoint (no pickle). Arrays are read
straight onto the shardings the live experiment has (orbax reshards onto
another mesh) or, in pmap mode, as one host copy replicated onto however many
devices this process has. A checkpoint whose checksums or digest do not
match, or that does not parse, is `UnusableCheckpoint`; one that is sound
but does not fit the experiment is refused (`checkpoint_fit`).
"""

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from jaxline_ng import checkpoint_format, devices, multihost
from jaxline_ng import mesh as mesh_lib
from jaxline_ng.checkpoint_fingerprints import dispatch_fingerprints, fingerprints_on_host
from jaxline_ng.checkpoint_fit import FlatLeaves, per_device_elsewhere, value_for
from jaxline_ng.checkpoint_format import (
  DROP_EXTRA_KEY,
  FORMAT,
  META_ITEM,
  META_KEYS,
  MODULE_PREFIX,
  STATE_ATTRS,
  STATE_ITEM,
  CheckpointRefused,
  DoesNotFit,
  UnusableCheckpoint,
  describe_topology,
  digest,
  named_entries,
  named_leaves,
  saved_steps,
)
from jaxline_ng.checkpoint_skeleton import names_classes


def orbax_processes(together: bool) -> ocp.options.MultiprocessingOptions:
  """The processes an orbax checkpointer involves: this one alone, or every one `together`.

  Orbax's default (every process, no names) synchronises with a device
  collective, which a training thread's collectives can block or interleave
  with (in `train_eval_multithreaded` a restore timed out). Alone, there is
  no barrier; naming the processes makes orbax's saves wait at the
  distributed runtime's barrier instead.
  """
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(
      primary_host=0 if together else me,
      active_processes=set(range(jax.process_count())) if together else {me})


def _reader() -> ocp.Checkpointer:
  """An orbax reader for this process alone, whatever the arrays' sharding.

  Orbax's barriers for processes reading together would wait for a process
  that failed before reaching them (a checkpoint rotated out under it), so
  processes reading arrays sharded over them each read their part alone and
  then agree on the outcome (`load`).
  """
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(),
                          multiprocessing_options=orbax_processes(together=False))


def read_meta(path: str) -> dict[str, Any]:
  """The checked JSON of a step directory; raises UnusableCheckpoint (or
  CheckpointRefused for another format) saying what is wrong."""
  if not os.path.lexists(path):  # A mistyped restore_path.
    raise UnusableCheckpoint("it does not exist")
  if os.path.isdir(os.path.join(path, "arrays")) and not os.path.isdir(
      os.path.join(path, STATE_ITEM)):
    raise CheckpointRefused(
        f"checkpoint {path} is in jaxline_ng's format 1 (items arrays/ and meta/, arrays "
        f"numbered); this version reads format {FORMAT} (a named orbax tree in state/). Resume "
        "it with the jaxline_ng that wrote it, or start a fresh run from its weights")
  if not os.path.isdir(os.path.join(path, META_ITEM)):
    raise UnusableCheckpoint(f"it is not a checkpoint: it has no {META_ITEM}/ item")
  try:
    meta = _reader().restore(
        os.path.abspath(path), args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
    )[META_ITEM]
  except Exception as e:  # pylint: disable=broad-except  (any damage makes it unusable)
    raise UnusableCheckpoint(f"its metadata does not load ({type(e).__name__}: {e})") from None
  if not isinstance(meta, dict) or set(meta) != META_KEYS:
    keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
    raise UnusableCheckpoint(f"its metadata has the entries {keys}, expected "
                             f"{sorted(META_KEYS)}")
  if meta["format"] != FORMAT:
    raise CheckpointRefused(f"checkpoint {path} has format {meta['format']!r}; this version "
                            f"reads format {FORMAT}")
  if meta["digest"] != digest(meta):
    raise UnusableCheckpoint("its metadata does not match the digest written with it "
                             "(changed or damaged after saving)")
  return meta


def _read_arrays(path: str, live_nest: dict[str, Any], training: bool, drop_extra: bool):
  """`load` up to the checksums: what every process does on its own."""
  meta = read_meta(path)
  # A renamed step directory would be resumed at its step, and orbax would
  # later refuse to save below the step its name claims. (`load` checks the
  # saved global_step against meta's step.)
  name = os.path.basename(os.path.normpath(path))
  if name.isdigit() and int(name) != meta["step"]:
    raise UnusableCheckpoint(f"it holds step {meta['step']}, but its directory is named {name}")
  # Without the same x64 setting its 64-bit arrays would not read back as they were written.
  saved_x64 = meta["topology"].get("x64", jax.config.jax_enable_x64)
  if saved_x64 != jax.config.jax_enable_x64:
    raise DoesNotFit(f"it was saved with jax_enable_x64={saved_x64}, and this run has "
                      f"{jax.config.jax_enable_x64}")
  live = named_entries(live_nest)
  wants_module = "experiment_module" in live_nest
  entries = meta["entries"]
  unlisted = set()  # Entries the live state does not list: not read.
  for name in entries:
    if name.startswith(MODULE_PREFIX):
      if wants_module and name not in live:
        if training and drop_extra:
          logging.warning("[jaxline_ng] Not restored (config.%s): %s, which the experiment "
                          "does not checkpoint.", DROP_EXTRA_KEY, name)
        if not training or drop_extra:  # As jaxline: e.g. no optimizer in eval.
          unlisted.add(name)
          continue
        raise DoesNotFit(f"it holds experiment_module/{name[len(MODULE_PREFIX):]}, "
                          "which the experiment does not checkpoint (config."
                          f"{DROP_EXTRA_KEY}=True resumes without it)")
    elif name not in STATE_ATTRS and name not in live:
      # As jaxline, which restores the live state's entries only: one that
      # `on_new_best_model` added to the best state is not a damage.
      unlisted.add(name)
  if wants_module:
    missing = sorted(name for name in live if name.startswith(MODULE_PREFIX)
                     and name not in entries)
    if missing:
      raise DoesNotFit(f"it lacks {', '.join(missing)}, which the experiment checkpoints")

  def wanted(name):
    return name not in unlisted and (wants_module or not name.startswith(MODULE_PREFIX))

  # The orbax tree to restore: one target per array of the entries wanted.
  targets: dict[str, Any] = {}
  restore_args: dict[str, Any] = {}
  expected = []  # (tree path, saved description)
  other_dtypes = []  # Arrays restored with another dtype than the live one.
  per_device = mesh_lib.placement().per_device
  for name, entry in entries.items():
    if not wanted(name):
      continue
    live_leaves = {} if name == "train_step_rng" else named_leaves(name, live.get(name))
    for leaf in entry["leaves"]:
      if "array" not in leaf:
        continue
      tree_path = leaf["array"]
      live_leaf = live_leaves.get("/".join(tree_path))
      saved = meta["arrays"]["/".join(tree_path)]
      shape, dtype = tuple(saved["shape"]), np.dtype(saved["dtype"])
      # The model's arrays (`live_layout` gives them as shapes) keep the
      # shapes `__init__` gives them; their dtype may drift as they train
      # (bfloat16 weights scaled by a float32), so it is the saved one, as
      # jaxline restored. Other arrays are restored as saved, as jaxline's
      # setattr did (a NON_BROADCAST buffer that grows): onto their live
      # devices where the saved shape fits them, else on the host.
      if name == "train_step_rng" and live.get(name) is not None and \
          shape[-1:] != np.shape(live[name])[-1:]:
        raise DoesNotFit(
            f"train_step_rng holds keys of {(shape or (0,))[-1]} words where this run's hold "
            f"{np.shape(live[name])[-1]} (another PRNG implementation: jax_default_prng_impl)")
      if (isinstance(live_leaf, jax.ShapeDtypeStruct) and tuple(live_leaf.shape) != shape) or (
          isinstance(live_leaf, jax.Array) and per_device_elsewhere(live_leaf, shape, meta)):
        saved_by = describe_topology(meta["topology"])
        now = describe_topology(checkpoint_format.current_topology())
        raise DoesNotFit(
            f"{'/'.join(tree_path)} has shape {shape} but the experiment's __init__ makes it "
            f"{tuple(live_leaf.shape)}"
            + (f" (saved by {saved_by}, now {now})" if saved_by != now else ""))
      live_dtype = getattr(live_leaf, "dtype", None)
      if live_dtype is not None and not jax.dtypes.issubdtype(live_dtype, jax.dtypes.extended) \
          and np.dtype(live_dtype) != dtype:
        other_dtypes.append(f"{'/'.join(tree_path)} {dtype} (__init__ makes {live_dtype})")
      if isinstance(live_leaf, jax.Array) and not devices.holds_shape(
          live_leaf, shape, pmap_layout=per_device):
        live_leaf = None
      sharding = getattr(live_leaf, "sharding", None)
      if sharding is not None and not per_device and len(sharding.device_set) > 1:
        arg = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
        target = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
      else:
        arg = ocp.RestoreArgs(restore_type=np.ndarray)
        target = np.zeros((), dtype)  # Only its place in the tree matters.
      node_t, node_a = targets, restore_args
      for part in tree_path[:-1]:
        node_t, node_a = node_t.setdefault(part, {}), node_a.setdefault(part, {})
      node_t[tree_path[-1]], node_a[tree_path[-1]] = target, arg
      expected.append((tree_path, shape, dtype, saved["fingerprint"]))

  if other_dtypes:
    # Not refused: a dtype may drift as the state trains. But a model changed
    # to another precision would go on in the old one without a word.
    logging.warning("[jaxline_ng] Restored %d arrays in the dtype they were saved in: %s%s.",
                    len(other_dtypes), "; ".join(other_dtypes[:3]),
                    " and more" if len(other_dtypes) > 3 else "")
  restored: dict[str, Any] = {}
  if targets:
    try:
      restored = _reader().restore(
          os.path.abspath(path), args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeRestore(
              item=targets, restore_args=restore_args, partial_restore=True)}))[STATE_ITEM]
    except Exception as e:  # pylint: disable=broad-except  (any damage makes it unusable)
      raise UnusableCheckpoint(f"its arrays do not load ({_one_line_reason(e)})") from None

  def at(tree_path):
    node = restored
    for part in tree_path:
      if not isinstance(node, dict) or part not in node:
        raise UnusableCheckpoint(f"array {'/'.join(tree_path)} is missing")
      node = node[part]
    return node

  return meta, entries, live, wanted, expected, at


# Where TensorStore's and orbax's messages go on to print a whole TensorStore
# spec (~1 kB of JSON over some 60 lines): the reason is what comes before.
_SPEC_MARKERS = (" [tensorstore_spec=", " See full TensorStore details:")


def _one_line_reason(error: BaseException) -> str:
  """`error`'s type and first line without TensorStore's spec, and its cause's
  (orbax's own message names only the array it was reading)."""
  parts = []
  while error is not None and len(parts) < 2:
    text = str(error)
    for marker in _SPEC_MARKERS:
      text = text.split(marker, 1)[0]
    first_line = text.strip().partition("\n")[0]
    parts.append(f"{type(error).__name__}: {first_line}")
    error = error.__cause__
  return "; caused by ".join(parts)


def raise_agreed(error: Exception | None, agree: bool) -> None:
  """Raises `error`; with `agree`, every process raises what any one found:
  each refuses what one refuses, or falls back where one does."""
  if not agree:
    if error is not None:
      raise error
    return
  # Per process: whether it found damage, and whether a mismatch, so each names the others.
  found = np.zeros((2, jax.process_count()), np.int32)
  found[:, jax.process_index()] = (isinstance(error, UnusableCheckpoint),
                                   isinstance(error, CheckpointRefused))
  damaged, mismatched = (np.flatnonzero(row).tolist() for row in multihost.all_reduce_sum(found))
  if error is not None:
    raise error
  if mismatched:
    raise DoesNotFit(f"the state of process {', '.join(map(str, mismatched))} does not fit it "
                      "(its log names the difference)")
  if damaged:
    raise UnusableCheckpoint(f"process {', '.join(map(str, damaged))} could not read its part")


def load(path: str, live_nest: dict[str, Any], agree: bool = False, training: bool = False,
          drop_extra: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
  """Reads and checks a step directory: `(snapshot, its topology)`.

  Arrays are restored onto the shardings of the live arrays they replace
  where those span several devices of a mesh, else as host arrays; entries
  of the experiment are read only when `live_nest` has an experiment.
  With `agree` (arrays sharded over the processes, each reading its part),
  the processes learn whether every one read its part before verifying the
  checksums: that is a collective, which all must enter or none.
  """
  error = None
  try:
    meta, entries, live, wanted, expected, at = _read_arrays(path, live_nest, training,
                                                             drop_extra)
    values = [at(tree_path) for tree_path, *_ in expected]
  except DoesNotFit as e:
    error = e
  except CheckpointRefused:
    raise
  except UnusableCheckpoint as e:
    error = e
  except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
    error = UnusableCheckpoint(f"its metadata is malformed ({type(e).__name__}: {e})")
  raise_agreed(error, agree)
  for (tree_path, shape, dtype, _), value in zip(expected, values):
    if tuple(value.shape) != shape or np.dtype(value.dtype) != dtype:
      raise UnusableCheckpoint(f"array {'/'.join(tree_path)} is {value.dtype}{list(value.shape)} "
                               f"on disk, {dtype}{list(shape)} in its metadata")
  # A checksum of a restored sharded array dispatches a collective: every
  # process restores the same entries, so they dispatch them alike.
  for (tree_path, *_, fingerprint), got in zip(
      expected, fingerprints_on_host(dispatch_fingerprints(values))):
    if got != fingerprint:
      raise UnusableCheckpoint(f"array {'/'.join(tree_path)} does not match the checksum "
                               "written with it (damaged after saving)")

  def leaf_value(leaf):
    if "empty" in leaf:
      return np.zeros(leaf["empty"]["shape"], leaf["empty"]["dtype"])
    if "array" not in leaf:
      return leaf["value"]
    if "key_impl" in leaf:
      return jax.random.wrap_key_data(at(leaf["array"]), impl=leaf["key_impl"])
    # Orbax gives a NumPy scalar back as a 0-d array; its mark turns it back.
    return at(leaf["array"])[()] if leaf.get("numpy_scalar") else at(leaf["array"])

  nest: dict[str, Any] = {}
  error = None
  try:
    for name, entry in entries.items():
      if not wanted(name):
        continue
      leaves = [leaf_value(leaf) for leaf in entry["leaves"]]
      value = value_for(entry, leaves, live.get(name), name, training, drop_extra)
      if name.startswith(MODULE_PREFIX):
        nest.setdefault("experiment_module", {})[name[len(MODULE_PREFIX):]] = value
      else:
        nest[name] = value
  except CheckpointRefused as e:  # A process's own state: the others learn of it.
    error = e
  raise_agreed(error, agree)
  step = nest.get("global_step")
  if not isinstance(step, int) or isinstance(step, bool) or step != meta["step"] or step < 0:
    raise UnusableCheckpoint(f"its global_step {step!r} is not the step {meta['step']!r} "
                             "it was saved at")
  return nest, meta["topology"]


def read(checkpoint_dir: str, series: str = "latest",
         step: int | None = None) -> tuple[int, dict[str, Any]]:
  """Reads a checkpoint without an experiment: `(step, snapshot)`, arrays as NumPy.

  For scripts (exporting weights, comparing runs). Entries made of plain
  containers come back as dicts/lists/tuples; others (NamedTuples, optax
  states) as the list of their leaves in tree order. `step` defaults to the
  newest. Checksums are verified.
  """
  series_dir = os.path.join(checkpoint_dir, "checkpoints", series)
  steps = saved_steps(series_dir)
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {series_dir}")
  step = steps[-1] if step is None else step
  path = os.path.join(series_dir, str(step))
  meta = read_meta(path)
  live: dict[str, Any] = {"experiment_module": {}}
  for name, entry in meta["entries"].items():
    # Without the experiment's program, an entry of other nodes (NamedTuples
    # included: their classes may not be imported) is a flat list of its leaves.
    skeleton = entry["skeleton"]
    placeholder = (None if skeleton is not None and not names_classes(skeleton)
                   else FlatLeaves())
    if name.startswith(MODULE_PREFIX):
      live["experiment_module"][name[len(MODULE_PREFIX):]] = placeholder
    else:
      live[name] = placeholder
  nest, _ = load(path, live)
  return step, nest
