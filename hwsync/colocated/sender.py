"""WeightSender: the trainer's side of a sync on the same host, a Sender over shared buffers.

The pipeline (hwsync.sync.sender) runs each sync; the carrier (carrier.py) moves its bytes through
buffers every receiver maps. This class is the topology: where the control endpoint binds, how many
receivers a sync waits for, and which of the backend's transports carries the buckets.
"""

from __future__ import annotations

from hwsync.backend.interfaces import Backend, Transport
from hwsync.backend.registry import get_backend
from hwsync.colocated.carrier import SharedBuffers
from hwsync.sync.options import SenderOptions
from hwsync.sync.sender import Sender


class WeightSender(Sender):
    """The same-host path's sender: binds a control endpoint and sends named tensors to one or more WeightReceivers."""

    def __init__(self, endpoint: str | None = None, *, num_receivers: int = 1, transport: str | Transport | None = None,
                 backend: Backend | None = None, options: SenderOptions | None = None) -> None:
        """`endpoint`: ipc://PATH or tcp://HOST:PORT to bind (None: a private ipc:// one); `num_receivers`: how many
        WeightReceivers each sync waits for; `transport`: one of the backend's (None: its default); `options`: the
        settings every sender takes (hwsync.SenderOptions)."""
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers} must be at least 1")
        backend = backend or get_backend()
        options = options or SenderOptions()
        self.transport = _resolve_transport(backend, transport)
        self.num_receivers = num_receivers
        super().__init__(backend, options, lambda closing: SharedBuffers(
            backend, self.transport, endpoint, num_receivers, options, closing))

    @property
    def _carrier(self) -> SharedBuffers:
        carrier = self._pipeline.carrier
        assert isinstance(carrier, SharedBuffers)
        return carrier

    @property
    def endpoint(self) -> str:
        """What a WeightReceiver connects to: address, token and (tcp://) CURVE public key. A secret: never log it."""
        return self._carrier.endpoint

    @property
    def address(self) -> str:
        """The bound address alone (no token, no key): what logs and errors name."""
        return self._carrier.address


def _resolve_transport(backend: Backend, transport: str | Transport | None) -> Transport:
    if isinstance(transport, Transport):
        return transport
    if transport is None:
        return backend.default_transport()
    available = backend.transports()
    if transport not in available:
        raise ValueError(f"backend {backend.name!r} has no transport {transport!r}; it has {sorted(available)}")
    return available[transport]
