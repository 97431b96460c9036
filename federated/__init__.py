"""Federated training with Flower over the on-device runtime (ClientApp, ServerApp, runners)."""

from .codec import CODECS, decode, encode
from .errors import ArtifactMismatchError, CodecError, DeployError, FederatedError, PartitionError
from .partition import dirichlet, iid, partition
from .runner import deploy, simulate
from .strategy import STRATEGIES, GuardedStrategy, make_strategy

__all__ = [
    "simulate",
    "deploy",
    "make_strategy",
    "GuardedStrategy",
    "STRATEGIES",
    "partition",
    "iid",
    "dirichlet",
    "encode",
    "decode",
    "CODECS",
    "FederatedError",
    "PartitionError",
    "CodecError",
    "ArtifactMismatchError",
    "DeployError",
]
