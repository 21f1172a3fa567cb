"""The control plane's small parts: endpoint strings, the drop log's rate limit, CURVE's absence, frame limits."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import zmq

from hwsync import HwsyncError, WeightReceiver, WeightSender
from hwsync.errors import ProtocolError
from hwsync.sync.spec import manifest_from_tensors
from hwsync.control.endpoints import Endpoint
from hwsync.protocol import MAX_MESSAGE_CHARS, MAX_PEER_FRAME_BYTES, cut
from hwsync.control.sockets import DropLog, require_curve
from hwsync.sync.options import CrossNodeOptions, SenderOptions

KEY = "ab" * 32


@pytest.mark.parametrize("text,address,token,key", [
    ("ipc:///tmp/hwsync-x/control#t0k", "ipc:///tmp/hwsync-x/control", "t0k", None),
    ("ipc:///tmp/a#b/control#t0k", "ipc:///tmp/a#b/control", "t0k", None),  # a '#' in the socket path
    (f"tcp://10.0.0.1:5555#t0k#{KEY}", "tcp://10.0.0.1:5555", "t0k", KEY),
])
def test_endpoint_strings_round_trip(text, address, token, key):
    endpoint = Endpoint.parse(text)
    assert (endpoint.address, endpoint.token, endpoint.server_key) == (address, token, key)
    assert str(endpoint) == text


@pytest.mark.parametrize("text,says", [
    ("tcp://10.0.0.1:5555#t0k", "has no CURVE key"),
    ("tcp://10.0.0.1:5555#t0k#notakey", "pass sender.endpoint as it is"),
    ("localhost:5555", "pass sender.endpoint as it is"),
    ("ipc:///tmp/x", "pass sender.endpoint as it is"),
])
def test_malformed_endpoints_name_the_fix(text, says):
    with pytest.raises(ValueError, match=says):
        Endpoint.parse(text)


def test_a_tcp_sender_prints_its_key_and_an_ipc_sender_none():
    with WeightSender("tcp://127.0.0.1:0") as tcp, WeightSender() as ipc:
        assert Endpoint.parse(tcp.endpoint).server_key is not None
        assert Endpoint.parse(ipc.endpoint).server_key is None and ipc.endpoint.count("#") == 1


def test_without_curve_a_tcp_endpoint_says_what_to_install(monkeypatch):
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(HwsyncError, match="built without; install pyzmq's own wheel"):
        require_curve()
    with pytest.raises(HwsyncError, match="CURVE"):
        WeightSender("tcp://127.0.0.1:0")
    WeightSender().close()  # ipc:// needs no CURVE


def test_the_drop_log_names_the_peer_once_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="hwsync")
    clock = [100.0]
    drops = DropLog("the sender", clock=lambda: clock[0])
    for _ in range(1000):
        drops.drop(b"\x00\x01", "10.1.2.3", "garbage")
    assert caplog.text.count("dropped a frame") == 1 and "peer 0001 at 10.1.2.3: garbage" in caplog.text
    clock[0] += 11
    drops.drop(b"\x00\x01", "10.1.2.3", "garbage")
    assert caplog.text.count("dropped a frame") == 2 and "(999 more dropped since the last report)" in caplog.text
    assert drops.total == 1001
    for n in range(10 * DropLog.MAX_PEERS):  # a stranger reconnecting again and again: the table stays small
        drops.drop(n.to_bytes(4, "big"), "", "garbage")
    assert len(drops._peers) <= DropLog.MAX_PEERS


def test_a_receivers_frames_are_held_to_the_limit_before_they_leave():
    with WeightSender(options=SenderOptions(timeout_s=2)) as sender, WeightReceiver(sender.endpoint, timeout_s=2) as receiver:
        with pytest.raises(ProtocolError, match=f"over the protocol's {MAX_PEER_FRAME_BYTES}-byte limit"):
            receiver.receive(lambda pairs: None, state={"blob": "x" * MAX_PEER_FRAME_BYTES})


def test_messages_are_cut_before_they_travel():
    assert cut("x" * 10) == "x" * 10
    long = cut("x" * (10 * MAX_MESSAGE_CHARS))
    assert len(long) <= MAX_MESSAGE_CHARS and long.endswith(f"({10 * MAX_MESSAGE_CHARS} chars)")


def test_a_manifest_over_the_senders_limit_is_refused_before_it_is_sent(monkeypatch):
    monkeypatch.setattr("hwsync.colocated.carrier.MAX_SENDER_FRAME_BYTES", 1000)
    tensors = [(f"layer.{i}.weight", torch.ones(1)) for i in range(100)]
    with WeightSender(options=SenderOptions(timeout_s=10)) as sender, WeightReceiver(sender.endpoint, timeout_s=10) as receiver:
        errors: list[BaseException] = []
        thread = threading.Thread(target=lambda: _catch(errors, receiver.receive, lambda pairs: None))
        thread.start()
        with pytest.raises(ProtocolError, match="the offer of 100 tensors takes .* over the protocol's 1000-byte"):
            sender.send(tensors, version=1, manifest=manifest_from_tensors(tensors))
        thread.join(10)
    assert errors and "aborted" in str(errors[0])


def _catch(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)


def test_an_endpoint_announced_before_its_bind_is_bound_with_its_own_key(monkeypatch):
    """verl's rank 0 announces its endpoint (with the CURVE public key) before it binds it."""
    from hwsync.disaggregated import CrossNodeSender
    from hwsync.control.sockets import curve_key_pair

    monkeypatch.setenv("HWSYNC_BACKEND", "cpu")
    public, secret = curve_key_pair()
    with socket_free_port() as port:
        announced = f"tcp://127.0.0.1:{port}#{'ab' * 16}#{public}"
    with pytest.raises(ValueError, match=r"pass CrossNodeOptions\(secret_key="):
        CrossNodeSender(announced, group_host="127.0.0.1")
    with pytest.raises(ValueError, match="does not belong to the endpoint's CURVE key"):
        CrossNodeSender(announced, group_host="127.0.0.1", options=CrossNodeOptions(secret_key=curve_key_pair()[1]))
    tx = CrossNodeSender(announced, group_host="127.0.0.1", options=CrossNodeOptions(secret_key=secret))
    try:
        assert tx.endpoint == announced
    finally:
        tx.close()


class socket_free_port:
    """A port free on 127.0.0.1 now (the socket is closed when the block ends)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return self._sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self._sock.close()
