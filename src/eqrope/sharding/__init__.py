"""Many devices: the device mesh, and rules that place each array by its logical axes.

The rules read the weight table of `eqrope.weights`; generation pins its cache with them.
"""

from ._mesh import make_mesh as make_mesh
from ._rules import (
    ShardingRules as ShardingRules,
    shard as shard,
    shard_batch as shard_batch,
    shardings as shardings,
)
