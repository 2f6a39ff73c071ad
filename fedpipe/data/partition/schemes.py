"""The `partition` config section (the union of the schemes' configs) and the scheme -> partitioner table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, get_args

import numpy as np
from pydantic import Field, TypeAdapter

from fedpipe.data.partition.base import _PartitionBase
from fedpipe.data.partition.dirichlet import DirichletPartition, dirichlet
from fedpipe.data.partition.label_skew import (
    ClassesPerClientPartition,
    MajorityClassPartition,
    PathologicalPartition,
    RandomClassSharesPartition,
    classes_per_client,
    majority_class,
    pathological_shards,
    random_class_shares,
)
from fedpipe.data.partition.natural import NaturalPartition
from fedpipe.data.partition.sampling import IidPartition, WithReplacementPartition, iid, with_replacement
from fedpipe.data.partition.semantic import SemanticGroupsPartition, semantic_groups

PartitionConfig = Annotated[
    (
        IidPartition
        | PathologicalPartition
        | ClassesPerClientPartition
        | DirichletPartition
        | MajorityClassPartition
        | RandomClassSharesPartition
        | SemanticGroupsPartition
        | WithReplacementPartition
        | NaturalPartition
    ),
    Field(discriminator="scheme"),
]
"""The `partition` config section: one of the schemes, chosen by its `scheme` field."""

_CONFIG_ADAPTER: TypeAdapter[Any] = TypeAdapter(PartitionConfig)

#: Scheme name -> its config class (the members of the PartitionConfig union).
SCHEME_CONFIGS: dict[str, type[_PartitionBase]] = {
    cls.model_fields["scheme"].default: cls for cls in get_args(get_args(PartitionConfig)[0])
}


def parse_partition_config(data: Any) -> Any:
    """Validate a mapping (e.g. ``{"scheme": "dirichlet", "num_clients": 20}``) into a PartitionConfig.

    Raises pydantic.ValidationError naming the offending field."""
    if isinstance(data, _PartitionBase):
        return data
    return _CONFIG_ADAPTER.validate_python(data)


Partitioner = Callable[..., list[np.ndarray]]

#: Scheme name (the config's `scheme`) -> partitioner function.
PARTITIONERS: dict[str, Partitioner] = {
    "iid": iid,
    "pathological": pathological_shards,
    "classes_per_client": classes_per_client,
    "dirichlet": dirichlet,
    "majority_class": majority_class,
    "random_class_shares": random_class_shares,
    "semantic_groups": semantic_groups,
    "with_replacement": with_replacement,
}
