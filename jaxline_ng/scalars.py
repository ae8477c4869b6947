"""What `step` and `evaluate` return: checks that it can be logged, and host numbers.

A scalar is a number, a 0-d array, or one value per local device (a pmap
output the experiment did not reduce with `get_first`), of which the first
device's is logged. Anything else is a `ScalarsError` naming the key.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxline_ng import devices, errors


class ScalarsError(ValueError, errors.OneLineError):
  """What `step` or `evaluate` returned cannot be logged; the message names the key."""


# Array kinds that are not real numbers, which TensorBoard and JSON take:
# complex, bytes, str, object.
_UNLOGGABLE_KINDS = "cSUO"


def _scalar_problem(name: Any, value: Any) -> str | None:
  """Why `value` is not a loggable scalar named `name`, or None if it is: a
  number, or one per device (a pmap output, or one value copied per device)."""
  if not isinstance(name, str):
    return f"has a name of type {type(name).__name__}, not a string"
  if isinstance(value, (int, float)):
    return None
  if isinstance(value, (str, bytes)):
    return f"is a {type(value).__name__} ({value!r:.40})"
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is None or dtype is None:
    return f"is a {type(value).__name__}"
  if getattr(dtype, "kind", "") in _UNLOGGABLE_KINDS:
    return f"has dtype {dtype}"
  if not shape or shape == (1,):
    return None
  # One value per device: per local device from pmap, per device of a mesh.
  if len(shape) == 1 and shape[0] in (jax.local_device_count(), jax.device_count()):
    if devices.one_row_per_device(value):
      return None
    # Copied per device, the first is all of them; a vector's (per-class) is not.
    if devices.equal_rows(value):
      return None
    return (f"is a vector of {shape[0]} differing values, not one per device (its first alone "
            "would be logged)")
  return f"has shape {tuple(shape)}"


def scalar_problems(scalars: Any, producer: str) -> dict[Any, str]:
  """`{name: one line saying why it cannot be logged}` for each bad value of `scalars`.

  Raises ScalarsError if `scalars` is not a mapping at all.
  """
  if not isinstance(scalars, Mapping):
    raise ScalarsError(f"{producer} returned {type(scalars).__name__} {scalars!r:.60}: return a "
                       "dict of scalars {name: value} (an empty dict to log nothing)")
  problems = {}
  for name, value in scalars.items():
    problem = _scalar_problem(name, value)
    if problem is not None:
      problems[name] = (f"{producer} returned scalar {name!r} that {problem}: return numbers, "
                        "or one per local device")
  return problems


def check_scalars(steps: Sequence[Mapping[str, Any]], producer: str) -> None:
  """Raises ScalarsError naming the first value of `steps` that cannot be logged."""
  for scalars in steps:
    for problem in scalar_problems(scalars, producer).values():
      raise ScalarsError(problem)


def host_scalars_of_steps(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Training steps' outputs as host numbers for logging (the first device's of
  per-device values); anything else is a ScalarsError naming the scalar."""
  check_scalars(steps, "step()")
  return [numbers(devices.first_copy_to_host(dict(scalars))) for scalars in steps]


def numbers(values: dict[str, Any]) -> dict[str, Any]:
  """Host values as Python numbers; one per device (shape [1]) gives its number."""
  for name, value in values.items():
    if not isinstance(value, (int, float)):
      array = np.asarray(value)
      values[name] = (array[0] if array.ndim == 1 else array).item()
  return values
