"""hwsync: move model weights from a trainer into running inference engines, on any backend."""

# Before anything imports torch: a backend may need to fix the environment first (see _pretorch).
from hwsync._pretorch import run_pre_torch_hooks as _run_pre_torch_hooks

_run_pre_torch_hooks()

from hwsync.errors import (
    BackendError,
    ClosedError,
    HwsyncError,
    ManifestError,
    ProtocolError,
    RemoteError,
    SourceError,
    SyncError,
    SyncTimeoutError,
)
from hwsync.interfaces import Backend, Communicator, Device, ProbeResult, Transport
from hwsync.manifest import TensorSpec, manifest_from_module, manifest_from_tensors
from hwsync.memory import (
    BalanceResult,
    BucketChoice,
    MemoryImbalanceError,
    MemoryReport,
    check_balance,
    choose_bucket_bytes,
    memory_report,
)
from hwsync.offload import OnloadStats, onload
from hwsync.planner import EngineState, SendSet, SyncMode, SyncPlan, TrainerModel, plan_for_engines, plan_sync
from hwsync.registry import get_backend, select_backend
from hwsync.shared_params import SharedParameters, SharedTensors, share_parameters
from hwsync.stats import SyncStats
from hwsync.colocated import WeightReceiver, WeightSender  # noqa: I001 - the paths build on the core above
from hwsync.disaggregated import CrossNodeReceiver, CrossNodeSender, LocalForwarder

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "ClosedError", "Communicator", "Device", "HwsyncError", "ManifestError", "ProbeResult",
    "ProtocolError", "RemoteError", "SyncError", "SyncStats", "SyncTimeoutError", "TensorSpec", "Transport",
    "WeightReceiver", "WeightSender", "get_backend", "manifest_from_module", "manifest_from_tensors",
    "select_backend", "BalanceResult", "BucketChoice", "MemoryImbalanceError", "MemoryReport", "check_balance",
    "choose_bucket_bytes", "memory_report", "OnloadStats", "onload", "EngineState", "SendSet", "SyncMode", "SyncPlan",
    "TrainerModel", "plan_for_engines", "plan_sync", "SourceError", "CrossNodeReceiver", "CrossNodeSender",
    "LocalForwarder", "SharedParameters", "SharedTensors", "share_parameters",
]
