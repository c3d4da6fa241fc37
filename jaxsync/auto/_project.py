"""``python -m jaxsync tune --project``: the cost model's figures on paper.

What it is for: predicted sync times per strategy and ``auto``'s choice for 8 to
1024 hosts x 8 devices, on a ResNet-50-sized and a 1 B-parameter tree, with
stated link figures (NVLink-class inside a host; 100 and 400 Gb/s between
hosts), so a user can see where hierarchical and two-dimensional pay off
before renting the cluster. Nothing is measured.

May import: the standard library, JAX (shapes only) and ``jaxsync.auto._cost``,
``_cost_ops``, ``_auto_choose``; ``_auto`` (profiles) and ``jaxsync.bench.trees``
inside ``explain_tree``, for ``info --tree``.

Example:
  >>> from jaxsync.auto import _project
  >>> rows = _project.project(hosts=(8,))
  >>> sorted({r["tree"][:9] for r in rows})
  ['1 B-param', 'ResNet-50']
"""

from __future__ import annotations

import math

from ._cost import Link, Profile
from ._cost_ops import ModelTopology


def _spec(shape, dtype="float32"):
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def resnet50_tree() -> dict:
    """ResNet-50's parameter shapes: 161 leaves, 25.6 M float32."""
    tree = {}

    def conv(name, k, cin, cout):
        tree[name] = {
            "kernel": _spec((k, k, cin, cout)),
            "bn": {"scale": _spec((cout,)), "bias": _spec((cout,))},
        }

    conv("stem", 7, 3, 64)
    cin = 64
    for stage, (blocks, w) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
        for b in range(blocks):
            conv(f"s{stage}b{b}c1", 1, cin, w)
            conv(f"s{stage}b{b}c2", 3, w, w)
            conv(f"s{stage}b{b}c3", 1, w, 4 * w)
            if b == 0:
                conv(f"s{stage}b{b}down", 1, cin, 4 * w)
            cin = 4 * w
    tree["fc"] = {"kernel": _spec((2048, 1000)), "bias": _spec((1000,))}
    return tree


def transformer_1b_tree() -> dict:
    """A 1.0 B-parameter transformer: 18 layers, d=2048, ff=8192, 50k vocabulary, f32."""
    d, ff = 2048, 8192

    def dense(a, b):
        return {"kernel": _spec((a, b)), "bias": _spec((b,))}

    tree = {
        f"layer{i:02d}": {
            "qkv": dense(d, 3 * d),
            "out": dense(d, d),
            "mlp_in": dense(d, ff),
            "mlp_out": dense(ff, d),
            "ln1": {"scale": _spec((d,)), "bias": _spec((d,))},
            "ln2": {"scale": _spec((d,)), "bias": _spec((d,))},
        }
        for i in range(18)
    }
    tree["embed"] = _spec((50304, d))
    return tree


def projection_profiles() -> dict[str, Profile]:
    """Stated link figures for the projection (GPU hosts with 8 devices each)."""
    nvlink = Link(alpha=5e-6, beta=1 / 150e9, gamma=1 / 1000e9)  # NVLink-class, GPU sums
    copy = 2 / 1000e9  # HBM read + write
    return {
        "100 Gb/s, 1 NIC/host": Profile(
            (("device", nvlink), ("network", Link(10e-6, 1 / 12.5e9, 1 / 1000e9, 1))),
            copy,
            None,
            "projection",
        ),
        "400 Gb/s, 1 NIC/GPU (8 rails)": Profile(
            (("device", nvlink), ("network", Link(10e-6, 1 / 50e9, 1 / 1000e9, 8))),
            copy,
            None,
            "projection",
        ),
    }


PROJECT_HOSTS = (8, 64, 512, 1024)


def project(hosts=PROJECT_HOSTS, devices: int = 8) -> list[dict]:
    """Predicted sync time per strategy and auto's choice, hosts x ``devices``."""
    from ._choose import choose

    trees = {
        "ResNet-50 (25.6 M f32, 161 leaves)": resnet50_tree(),
        "1 B-param transformer (f32, 217 leaves)": transformer_1b_tree(),
    }
    rows = []
    for net, prof in projection_profiles().items():
        for tname, tree in trees.items():
            for h in hosts:
                topo = ModelTopology(
                    processes=h, hosts=h, local_devices=devices, native=False, broadcast=True
                )
                c = choose(tree, topo, prof)
                best: dict = {}
                for s, _b, _t, sec in c.table:
                    best[s] = min(best.get(s, math.inf), sec)
                rows.append(
                    {
                        "network": net,
                        "tree": tname,
                        "hosts": h,
                        "devices": devices,
                        "ms": {s: round(v * 1e3, 3) for s, v in best.items()},
                        "choice": c.strategy,
                        "bucket_bytes": c.bucket_bytes,
                        "pack_threshold": c.pack_threshold,
                    }
                )
    return rows


def projection_table(rows) -> str:
    strategies = list(rows[0]["ms"]) if rows else []
    head = (
        "| network | tree | hosts x 8 | "
        + " | ".join(f"`{s}`" for s in strategies)
        + " | auto picks |"
    )
    lines = [head, "|" + "---|" * (4 + len(strategies))]
    for r in rows:
        cells = [f"{r['ms'][s]:.2f} ms" for s in strategies]
        lines.append(
            f"| {r['network']} | {r['tree']} | {r['hosts']} | "
            + " | ".join(cells)
            + f" | `{r['choice']}` |"
        )
    return "\n".join(lines)


def named_trees() -> dict:
    """Trees ``info --tree`` knows: the bench's and the projection's."""
    from jaxsync.bench import trees as _trees

    return {
        **_trees.make_trees(False),
        **_trees.make_trees(True),
        "resnet50": resnet50_tree,
        "transformer1b": transformer_1b_tree,
    }


def explain_tree(name: str, topo: dict, profile=None) -> str:
    """What ``strategy="auto"`` would choose for tree ``name`` on ``topo``
    (``python -m jaxsync info --tree NAME``; ``topo`` as ``Topology.as_dict()``)."""
    trees = named_trees()
    if name not in trees:
        raise SystemExit(f"jaxsync info: unknown tree {name!r}; choose from {sorted(trees)}")
    from ._auto import load_profile
    from ._choose import choose

    prof, note = load_profile(profile)
    size = int(topo["size"])
    model = ModelTopology(
        processes=size,
        hosts=int(topo["hosts"]),
        local_devices=int(topo["local_devices"]),
        native=topo.get("platform") == "cpu" and size > 1,
        broadcast=size > 1,
    )
    return choose(trees[name](), model, prof, profile_note=note).describe()
