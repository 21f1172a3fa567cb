"""Strangers whose frames have fields of the wrong type (a map as the type tag, a list as the token), with real
processes and sockets, over ipc:// and tcp:// (a stranger that completed the CURVE handshake with the
sender's public key but holds no token).

Issue 32, item 1: a msgpack map whose `t` was a map made the sender's next send() raise
`TypeError: unhashable type: 'dict'` (the gate looked the raw tag up in a dict), and the real
receiver waited out its timeout. Whatever the stranger sends, the next sync must complete bit-exact
at its first attempt, and the stranger is logged.
"""

from __future__ import annotations

import logging

import msgpack
import pytest

from test_control_plane import TRANSPORTS, Session, log_every_drop  # noqa: F401 - log_every_drop is a fixture

#: a Ready as a stranger would make it: every field there, no token
REPORT = {"engine": None, "dtypes": None, "held": None, "memory": None, "extra": {}}
READY = {"t": "ready", "proto": 6, "pid": 1, "host": "h", "report": REPORT, "doorbell": False, "into": False,
         "backend": "cpu", "transports": ["shm"], "instance": "x"}

HOSTILE = {
    "map as type": {"t": {"a": 1}},
    "list as type": {"t": [1, 2]},
    "nested map as type": {"t": {"t": {"t": "ready"}}, "token": "x"},
    "float as type": {"t": float("nan")},
    "bytes as type": {"t": b"ready"},
    "map as token": {**READY, "token": {"x": 1}},
    "list as token": {**READY, "token": ["x"]},
    "map as proto": {**READY, "token": "wrong", "proto": {"v": 6}},
    "map as pid": {**READY, "token": "wrong", "pid": {}},
    "huge pid": {**READY, "token": "wrong", "pid": (1 << 64) - 1},
    "non-str extra keys": {**READY, "token": "wrong", "report": {**REPORT, "extra": {1: 2, None: 3}}},
    "nan in memory": {**READY, "token": "wrong", "report": {**REPORT, "memory": {"rank": 0, "free": float("nan"),
                                                                                  "total": 1, "allocated": 0,
                                                                                  "reserved": 0}}},
    "a report without its keys": {**READY, "token": "wrong", "report": {"engine": None}},
}


def _messages(names: list[str]) -> list[list[bytes]]:
    out = [[msgpack.packb(HOSTILE[n], use_bin_type=True)] for n in names]
    out.append([b"\x82\xa1t" + b"\x91" * 1000 + b"\xc0" + b"\xa1x\x01"])  # a type tag nested 1000 deep
    return out


@pytest.fixture(scope="module")
def session(request):
    s = Session(request.param)
    yield s
    s.close()


@pytest.mark.parametrize("session", TRANSPORTS, indirect=True)
@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_frame_with_fields_of_the_wrong_type_never_ends_a_sync(session, name, caplog, log_every_drop):  # noqa: F811
    caplog.set_level(logging.WARNING, logger="hwsync")
    stranger = session.stranger(_messages([name]))
    stranger.wait(10)
    session.sync_exact()  # before the fix: TypeError (unhashable type) from send(), the receiver timed out
    assert "the sender dropped a frame from peer" in caplog.text
    assert max(len(r.getMessage()) for r in caplog.records) < 1200


@pytest.mark.parametrize("session", TRANSPORTS, indirect=True)
def test_wrong_types_raining_during_syncs_change_nothing(session, caplog):
    """Every hostile frame again and again while two syncs run."""
    caplog.set_level(logging.WARNING, logger="hwsync")

    def slowly(tensors):
        import time

        for item in tensors.items():
            time.sleep(0.05)
            yield item

    stranger = session.stranger(_messages(list(HOSTILE)), mode="repeat", seconds=1.5)
    session.sync_exact(slowly)
    session.sync_exact(slowly)
    stranger.wait(10)
    session.sync_exact()
