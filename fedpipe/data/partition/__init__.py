"""Non-IID partitions of a dataset over federated clients, and the partition artifact (manifest).

A partition is made in three steps (`make_partition`):

1. The global test set: the dataset's official test split when it has one; otherwise a stratified
   hold-out of `global_test_fraction` of the training pool (per class, largest-remainder rounding).
2. The rest of the pool is divided over clients by one scheme (a partitioner function, see
   `PARTITIONERS`): `iid`, `pathological`, `classes_per_client`, `dirichlet`, `majority_class`,
   `random_class_shares`, `semantic_groups`, `with_replacement`; or `natural`, which keeps the clients
   a user's own data names (`DatasetBundle.clients`, data.dataset=files).
3. Each client's samples are shuffled and split into train / validation / test
   (`val_fraction`, `test_fraction`, both rounded down, the training split keeps the rest), and
   `round(opt_out_fraction * K)` clients chosen at random are flagged opt-out.

All randomness comes from numpy Generators derived from the seed with `np.random.SeedSequence`, one
independent stream per purpose, so the same (data, config, seed) always gives the same partition.
Every index in a `Partition` is a row of `bundle.train`.

Partitioner functions share one signature,
``fn(labels, num_classes, rng, **scheme_params) -> list[np.ndarray]``: per-client arrays of
positions into `labels`, disjoint; samples that a scheme leaves unused belong to no client.

One scheme is the exception: `with_replacement` lets clients share samples (sampling with
replacement across clients, without replacement inside one client), so a small pool can stand in
for a population far larger than it (10,000 clients over mnist5k's 4,000 pool samples). Its configs
say so with `clients_share_samples`; the manifest then checks that each client's own indices are
distinct and that no client holds a global-test sample, instead of "every sample at most once".
It is a scheme of its own, not a flag on `iid`/`dirichlet`, so those configs, their fingerprints
and their partitions stay exactly what they were.
"""

from fedpipe.data.partition.dirichlet import DIRICHLET_MAX_DRAWS, DirichletPartition, dirichlet
from fedpipe.data.partition.feature_shift import FeatureShift
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
from fedpipe.data.partition.make import make_partition
from fedpipe.data.partition.manifest import MANIFEST_FORMAT, MANIFEST_VERSION, ClientSplit, Partition
from fedpipe.data.partition.natural import NaturalPartition
from fedpipe.data.partition.sampling import IidPartition, WithReplacementPartition, iid, with_replacement
from fedpipe.data.partition.schemes import PARTITIONERS, PartitionConfig, Partitioner, parse_partition_config
from fedpipe.data.partition.semantic import SemanticGroupsPartition, deal_label_clusters, semantic_groups

__all__ = [
    "DIRICHLET_MAX_DRAWS",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "PARTITIONERS",
    "ClassesPerClientPartition",
    "ClientSplit",
    "DirichletPartition",
    "FeatureShift",
    "IidPartition",
    "MajorityClassPartition",
    "NaturalPartition",
    "Partition",
    "PartitionConfig",
    "Partitioner",
    "PathologicalPartition",
    "RandomClassSharesPartition",
    "SemanticGroupsPartition",
    "classes_per_client",
    "deal_label_clusters",
    "dirichlet",
    "iid",
    "majority_class",
    "make_partition",
    "parse_partition_config",
    "pathological_shards",
    "random_class_shares",
    "semantic_groups",
    "with_replacement",
    "WithReplacementPartition",
]
