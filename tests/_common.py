"""Shared set-up of the single-process test modules (8 fake devices, see conftest)."""

import numpy as np

import jax
from jax.sharding import Mesh

N = 8
STRATEGIES = ["naive", "flat", "hierarchical", "two_dimensional", "single_node"]
INTER = [s for s in STRATEGIES if s != "single_node"]  # have an inter-process stage
MESH1 = Mesh(np.array(jax.devices()[:N]), ("i",))
MESH2 = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("host", "local"))
HL = ("host", "local")

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x) -> np.ndarray:
    """The raw bits of an array, for bitwise comparisons."""
    a = np.asarray(x)
    return a.view(_UINT[a.dtype.itemsize])
