"""Checksums of a checkpoint's arrays, computed where the arrays live."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxline_ng import debugging, devices


def _words(x):
  """`x`'s bits as uint32 words (elementwise, plus a trailing axis for 8-byte types)."""
  if jnp.iscomplexobj(x):
    return _words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  carrier = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  bits = x if x.dtype == carrier else jax.lax.bitcast_convert_type(x, carrier)
  return bits.astype(jnp.uint32)


@debugging.compiled
def _fingerprints(arrays):
  """Two position-weighted sums of each array's bits, mod 2**32: a checksum of
  the global value that does not depend on how it is sharded (integer sums
  reduce in any order), computed where the array lives, without a gather."""
  results = []
  for x in arrays:
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    for axis, size in enumerate(words.shape):
      index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    odd = index * jnp.uint32(2) + jnp.uint32(1)
    mixed = words ^ (words >> jnp.uint32(15))
    results.append(jnp.stack([
        jnp.sum(words * (odd * jnp.uint32(0x9E3779B1)), dtype=jnp.uint32),
        jnp.sum(mixed * (odd * jnp.uint32(0x85EBCA77)), dtype=jnp.uint32)]))
  return results


def dispatch_fingerprints(arrays: list) -> list:
  """`_fingerprints` of arrays wherever they are: one dispatch per device set.

  Host arrays are checksummed on the default device.
  """
  results: list = [None] * len(arrays)
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(arrays):
    key = frozenset(x.sharding.device_set) if isinstance(x, jax.Array) else None
    groups.setdefault(key, []).append(i)
  for indices in groups.values():
    for i, result in zip(indices, _fingerprints([arrays[i] for i in indices])):
      results[i] = result
  return results


def fingerprints_on_host(fingerprints: list) -> list[list[int]]:
  return [[int(v) for v in np.asarray(h)] for h in devices.first_copy_to_host(fingerprints)]
