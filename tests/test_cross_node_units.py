"""The cross-node control plane's decisions, without processes: which ready the hub holds, when a rank that readied
again may be started again in the running sync, and how a rank tells that a group store listens."""

from __future__ import annotations

import socket

from hwsync.disaggregated.roster import PeerInfo, Roster, restart_refusal, wanted
from hwsync.sync.report import ReceiverReport
from hwsync.control.nic import listening
from hwsync.protocol import TO_HUB, TO_RANK, Listening, RankReady, Start, Waiting, decode, encode


def _peer(rank: int = 0, attempt: int = 1, *, epoch: int | None = 3, state: dict | None = None,
          identity: bytes = b"a") -> PeerInfo:
    return PeerInfo("receiver", rank, identity, 1, "h", epoch, None, ReceiverReport(extra=state or {}), "10.0.0.2",
                    attempt)


def test_the_newest_ready_of_a_rank_replaces_the_one_it_gave_up_on():
    roster = Roster()
    assert roster.add(_peer(attempt=1)) is None
    assert roster.add(_peer(attempt=2)).attempt == 1
    keys = wanted(1, 2)
    assert keys == [("sender", 1), ("receiver", 0), ("receiver", 1)]
    assert roster.missing(keys) == [("sender", 1), ("receiver", 1)]
    text = roster.describe_missing(roster.missing(keys))
    assert text.startswith("sender 1 (not heard of yet), receiver 1 (not heard of yet)")
    roster.add(PeerInfo("sender", 1, b"s", 2, "h", None))
    roster.add(_peer(1, identity=b"b"))
    assert [p.attempt for p in roster.take(keys)] == [0, 2, 1] and not roster.waiting
    assert "receiver 1 (pid 1 on h, 10.0.0.2) (its last ready came" in roster.describe_missing([("receiver", 1)])


def test_a_rank_that_readied_again_is_started_again_only_where_its_new_ready_fits_the_sync():
    current = _peer(attempt=1, epoch=3, state={"v": 1})
    assert restart_refusal(current, _peer(attempt=2, epoch=3, state={"v": 1}), acted=False,
                           groups_announced=False) is None
    assert "already taken part" in restart_refusal(current, _peer(attempt=2, epoch=3, state={"v": 1}), acted=True,
                                                   groups_announced=False)
    assert "state changed" in restart_refusal(current, _peer(attempt=2, epoch=3, state={"v": 2}), acted=False,
                                              groups_announced=True)
    # it dropped its groups (epoch None): fine while new ones are announced, not on the old ones
    assert restart_refusal(current, _peer(attempt=2, epoch=None, state={"v": 1}), acted=False,
                           groups_announced=True) is None
    assert "group epoch None" in restart_refusal(current, _peer(attempt=2, epoch=None, state={"v": 1}), acted=False,
                                                 groups_announced=False)


def test_the_frames_that_name_attempts_and_syncs_round_trip():
    for frame, frames in ((Start(attempt=2, sync=7), TO_RANK), (Waiting(attempt=1, missing="receiver 1"), TO_RANK),
                          (Listening(sync=4), TO_HUB),
                          (RankReady(token="t", proto=1, backend="cpu", role="receiver", rank=0, epoch=None, pid=1,
                                     host="h", address=None, report=ReceiverReport(), attempt=3), TO_HUB)):
        assert decode(encode(frame), frames) == frame


def test_listening_sees_a_listening_socket_and_not_a_closed_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert listening(port) is False  # bound, not listening: a store that has not started yet
        s.listen()
        assert listening(port) is True
    assert listening(port) is False
