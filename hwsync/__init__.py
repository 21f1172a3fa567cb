"""hwsync: move model weights from a trainer into running inference engines, on any backend.

What a user needs is here (one screen: `hwsync.__all__`):

- the same-host path: `WeightSender` (trainer) and `WeightReceiver` (engine), through shared buffers;
  both senders take their settings as one typed object, `SenderOptions` (`CrossNodeOptions` across nodes);
- the cross-node path: `CrossNodeSender` (trainer ranks) and `CrossNodeReceiver` (engine ranks), over
  the backend's collective library; `LocalForwarder` hands a received sync on to the same-host path;
- what a sync sends: (name, tensor) pairs, a `Source` (its manifest, and a fresh iteration each sync), or a
  `TrainerModel` (a Source) planned against the `EngineState` each receiver reports (`SyncMode`: full, merged or
  unmerged LoRA); `TensorSpec` / `manifest_from_module` announce tensors before any byte moves;
  `SharedParameters` keeps a module where receivers read it in place;
- what a receiver says about its engine: `ReceiverState` (its `EngineState`, the dtypes it holds:
  `engine_dtypes(model)`, its own values); what the sender gets: `ReceiverReport`;
- `SyncStats`, what every sync returns; errors: the common ones here, every one in `hwsync.errors`.

Elsewhere, each for its own reader: backend authors `hwsync.backend`; the planner's internals
`hwsync.sync.planner`; per-rank memory reports and bucket sizing `hwsync.backend.memory`; engines and trainers
`hwsync.integrations`.
"""

# Before anything imports torch: a backend may need to fix the environment first (see _pretorch).
from hwsync._pretorch import run_pre_torch_hooks as _run_pre_torch_hooks

_run_pre_torch_hooks()

from hwsync.colocated import WeightReceiver, WeightSender  # noqa: E402
from hwsync.disaggregated import CrossNodeReceiver, CrossNodeSender, LocalForwarder, StagedForwarder  # noqa: E402
from hwsync.errors import (  # noqa: E402
    ClosedError,
    HwsyncError,
    ManifestError,
    NotAppliedError,
    PartlyAppliedError,
    StagingMemoryError,
    SyncError,
    SyncTimeoutError,
)
from hwsync.sync.options import CrossNodeOptions, SenderOptions  # noqa: E402
from hwsync.sync.planner import EngineState, SyncMode, TrainerModel  # noqa: E402
from hwsync.sync.report import ReceiverReport, ReceiverState, engine_dtypes  # noqa: E402
from hwsync.sync.shared_params import SharedParameters  # noqa: E402
from hwsync.sync.spec import Source, TensorSpec, manifest_from_module  # noqa: E402
from hwsync.sync.staging import StageOptions  # noqa: E402
from hwsync.sync.stats import SyncStats  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "WeightSender", "WeightReceiver", "CrossNodeSender", "CrossNodeReceiver", "LocalForwarder", "StagedForwarder",
    "SenderOptions", "StageOptions",
    "CrossNodeOptions", "ReceiverState", "ReceiverReport", "engine_dtypes", "SyncStats",
    "Source", "TrainerModel", "EngineState", "SyncMode", "TensorSpec", "manifest_from_module", "SharedParameters",
    "HwsyncError", "SyncError", "SyncTimeoutError", "ClosedError", "ManifestError",
    "NotAppliedError", "PartlyAppliedError", "StagingMemoryError",
]
