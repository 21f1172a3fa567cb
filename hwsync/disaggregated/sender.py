"""CrossNodeSender: a trainer rank's side of a sync to engines on other nodes, a Sender over collectives.

The pipeline (hwsync.sync.sender) runs each sync; the carriers (carrier.py) move its bytes over each
sender rank's process group: sender rank 0 is the hub of the control plane and plans, the other ranks
follow its plan. This class is the topology: the rank, how many senders and receivers, and the address
this rank's group binds.
"""

from __future__ import annotations

from hwsync.backend.interfaces import Backend
from hwsync.backend.registry import get_backend
from hwsync.control.endpoints import CloseSignal
from hwsync.disaggregated.addresses import choose_group_host, default_host, endpoint_host, pick_port
from hwsync.disaggregated.carrier import HubCarrier, RankCarrier, receiver_states
from hwsync.sync.options import CrossNodeOptions
from hwsync.sync.sender import Carrier, Sender

__all__ = ["CrossNodeSender", "choose_group_host", "default_host", "endpoint_host", "pick_port", "receiver_states"]


class CrossNodeSender(Sender):
    """The cross-node path's sender: one trainer rank; rank 0 also runs the control hub the other ranks connect to."""

    def __init__(self, endpoint: str | None = None, *, rank: int = 0, num_senders: int = 1, num_receivers: int = 1,
                 group_host: str | None = None, backend: Backend | None = None,
                 options: CrossNodeOptions | None = None) -> None:
        """A trainer rank's sender; rank 0 binds the control endpoint (its `.endpoint` goes to every other rank).

        `endpoint`: sender 0's address to bind (tcp://HOST:PORT, optionally #TOKEN or #TOKEN#KEY), for the other
        ranks sender 0's `.endpoint`. `group_host`: the address this rank's group binds, which every receiver must
        reach (see addresses.choose_group_host; sender 0 left without it and bound to a wildcard address takes the
        one its route to the receivers leaves from). `options`: the settings every sender takes, with the group's
        port and sender 0's CURVE secret key (hwsync.CrossNodeOptions). Sender 0 decides whether a sync is a delta
        and sends its every payload.
        """
        if not 0 <= rank < num_senders:
            raise ValueError(f"rank {rank} is outside num_senders={num_senders}")
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers} must be at least 1")
        if rank > 0 and (endpoint is None or "#" not in endpoint):
            raise ValueError(f"sender rank {rank} needs endpoint=<sender 0's .endpoint> (tcp://HOST:PORT#TOKEN#KEY)")
        backend = backend or get_backend()
        options = options or CrossNodeOptions()
        self.rank, self.num_senders, self.num_receivers = rank, num_senders, num_receivers

        def carrier(closing: CloseSignal) -> Carrier:
            if rank == 0:
                return HubCarrier(backend, endpoint, num_senders, num_receivers, group_host, options, closing)
            assert endpoint is not None
            return RankCarrier(rank, backend, endpoint, group_host, options, closing)

        super().__init__(backend, options, carrier)

    @property
    def _carrier(self) -> HubCarrier | RankCarrier:
        carrier = self._pipeline.carrier
        assert isinstance(carrier, (HubCarrier, RankCarrier))
        return carrier

    @property
    def endpoint(self) -> str:
        """Sender 0's control endpoint (address, token, CURVE key): pass it to every other rank. A secret: never
        log it."""
        carrier = self._carrier
        if not isinstance(carrier, HubCarrier):
            raise ValueError("only sender rank 0 has the endpoint; the other ranks connect to it")
        return carrier.hub.endpoint

    @property
    def group_host(self) -> str:
        """The address this rank's group binds."""
        return self._carrier.group_host

    @property
    def group_epoch(self) -> int | None:
        """Id of this rank's group (changes only when it is rebuilt), or None."""
        group = self._carrier.group
        return group.epoch if group.comm is not None else None

    def _delta_for(self, delta: bool | None) -> bool:
        # sender 0 decides whether a sync is a delta and sends it alone; the other ranks never keep a baseline
        return super()._delta_for(delta) and self.rank == 0
