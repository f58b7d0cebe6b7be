"""The device mesh: building one, and checking one against the sharding rules."""

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from .._checks import check_int
from .._custom_types import IntLike


MeshAxes = str | tuple[str, ...] | None


def make_mesh(data: IntLike | None = None, model: IntLike = 1, *, devices=None) -> Mesh:
    """A `(data, model)` mesh with automatic (compiler-chosen) sharding of intermediates.

    **Arguments:**

    - `data`: devices along the data-parallel axis; `None` uses all devices left after
      `model`.
    - `model`: devices along the tensor-parallel axis.
    - `devices`: the devices to use, default `jax.devices()` (every process's devices
      after `jax.distributed.initialize`); the first `data * model` are used.

    **Returns:** a `jax.sharding.Mesh` with axes `("data", "model")` of type
    `AxisType.Auto`. eqrope needs `Auto` axes: under `Explicit` axes JAX asks the model
    code itself to resolve shardings, which it does not do.
    """
    devices = list(jax.devices() if devices is None else devices)
    data = check_int(data, "data", minimum=1, none=True)
    model = check_int(model, "model", minimum=1)
    if data is None:
        if len(devices) % model != 0:
            raise ValueError(
                f"model={model} does not divide the {len(devices)} devices; pass data= too."
            )
        data = len(devices) // model
    if data * model > len(devices):
        raise ValueError(
            f"a (data={data}, model={model}) mesh needs {data * model} devices, but only "
            f"{len(devices)} are available."
        )
    return jax.make_mesh(
        (data, model),
        ("data", "model"),
        axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices[: data * model],
    )


def axis_names(axes) -> tuple:
    """The mesh axis names in a rule's value: `()` for `None` (replicated)."""
    return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def mesh_size(mesh: Mesh | AbstractMesh, axes: MeshAxes) -> int:
    """How many devices `axes` span together (1 for `None`)."""
    return int(np.prod([mesh.shape[n] for n in axis_names(axes)]))


def check_mesh(mesh, rules: dict[str, MeshAxes]) -> None:
    """Raise unless `mesh` is a mesh with an `Auto` axis for every mesh axis in `rules`.

    `rules` maps each logical axis to the mesh axes its `ShardingRules` field names.
    """
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (e.g. eqrope.make_mesh()), got {type(mesh).__name__}."
        )
    for logical, target in rules.items():
        for name in axis_names(target):
            if name not in mesh.shape:
                raise ValueError(
                    f"ShardingRules.{logical} names mesh axis {name!r}, but the mesh has axes "
                    f"{tuple(mesh.axis_names)}; build the mesh with it (eqrope.make_mesh gives "
                    f"'data' and 'model') or set ShardingRules({logical}=None)."
                )
            kind = mesh.axis_types[mesh.axis_names.index(name)]
            if kind != AxisType.Auto:
                raise TypeError(
                    f"mesh axis {name!r} has type {kind}; eqrope runs under XLA's automatic "
                    "partitioner and needs AxisType.Auto axes: build the mesh with "
                    "eqrope.make_mesh or jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)."
                )
