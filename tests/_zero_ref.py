"""The ZeRO tests' parameters and integer gradients (``test_zero.py``, ``mpi/worker_zero.py``).

Element ``i`` of the ``j``-th leaf (in name order) of replica ``r``'s gradient at step
``t`` is ``((3 r + i + 5 t + j) mod 11) - 5``: an integer in [-5, 5], so that with
power-of-two hyperparameters every product is exact. Import it after JAX's device
count is set (it makes the parameters).
"""

import jax.numpy as jnp
import numpy as np

PARAMS = {
    "b": jnp.zeros(()),
    "c": jnp.arange(7.0),
    "w": jnp.ones((3, 5)),
    "k": jnp.full((2, 3, 4), 2.0),
}
WD_MASK = {"b": False, "c": False, "w": True, "k": True}


def replica_grads(replicas, t):
    """Per leaf name, the gradients of ``replicas`` (replica ids) at step ``t``,
    stacked: numpy arrays of shape ``(len(replicas), *leaf.shape)``."""
    r = np.asarray(replicas, np.float32)[:, None]
    out = {}
    for j, (name, p) in enumerate(sorted(PARAMS.items())):
        v = ((r * 3 + np.arange(int(np.prod(p.shape))) + 5 * t + j) % 11) - 5
        out[name] = v.reshape((len(r),) + p.shape)
    return out
