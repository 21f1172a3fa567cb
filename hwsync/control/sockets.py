"""The control plane's sockets: bound and connected with the protocol's limits, CURVE on tcp://, watched.

- `bind_control`: the sender's (or hub's) ROUTER. Anyone who can reach its address can connect,
  so it refuses any message over protocol.limits.MAX_PEER_FRAME_BYTES (ZMQ_MAXMSGSIZE: ZeroMQ
  drops the connection before reading the bytes) and queues at most PEER_QUEUE_FRAMES per peer.
  On tcp:// it is a CURVE server with a fresh key pair: the channel is encrypted, and only a
  peer that knows the public key (from the endpoint string) can complete the handshake.
- `connect_control`: a receiver's (or rank's) DEALER, a CURVE client with an ephemeral key pair
  on tcp://, taking at most MAX_SENDER_FRAME_BYTES per message.
- `ConnectionWatch`: the DEALER's monitor. When the bound side closes its socket or its
  process dies, the connection drops and the watch says so at once, on any host; a CURVE
  handshake that fails (a wrong key) is named too.
- `ConnectionLog`: the bound socket's monitor. What ZeroMQ refuses on its own (a message over
  the limit, a failed CURVE handshake) never reaches hwsync as a frame; it shows as a dropped
  connection, which this logs.
- `DropLog`: the log of frames dropped from a peer, naming its identity and address, at most
  one line per peer every DROP_LOG_INTERVAL_S.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from hwsync.control.endpoints import Endpoint, peer_alive
from hwsync.errors import HwsyncError, ProtocolError, SyncTimeoutError
from hwsync.protocol import (
    MAX_PEER_FRAME_BYTES,
    MAX_SENDER_FRAME_BYTES,
    PEER_QUEUE_FRAMES,
    PROTOCOL_VERSION,
    BadFrame,
    Frame,
    Refused,
    Welcome,
    cut,
    decode,
    encode,
    peek,
)
from hwsync.protocol.fields import short
from hwsync.timing import DROP_LOG_INTERVAL_S, ERROR_LINGER_S

log = logging.getLogger("hwsync")

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def require_curve() -> None:
    """Raise HwsyncError when this pyzmq's libzmq lacks CURVE, which tcp:// endpoints need."""
    if not zmq.has("curve"):
        raise HwsyncError(
            f"tcp:// endpoints are encrypted with ZeroMQ CURVE, which this libzmq ({zmq.zmq_version()}, used by "
            f"pyzmq {zmq.__version__}) was built without; install pyzmq's own wheel (`pip install --force-reinstall "
            "pyzmq`, which bundles a libzmq with CURVE), or use an ipc:// endpoint on one host")


def curve_key_pair() -> tuple[str, str]:
    """A new CURVE key pair, (public, secret) as 64 hex digits: for an endpoint announced before it is bound."""
    require_curve()
    public, secret = zmq.curve_keypair()
    return z85.decode(public).hex(), z85.decode(secret).hex()


def bind_control(ctx: zmq.Context, address: str, secret_key: str | None = None) -> tuple[zmq.Socket, str, str | None]:
    """A bound ROUTER socket, its real address (a tcp port 0 resolved) and its CURVE public key (tcp://).

    On tcp:// the key pair is fresh unless `secret_key` (from curve_key_pair) is given.
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_FRAME_BYTES)
    sock.setsockopt(zmq.RCVHWM, PEER_QUEUE_FRAMES)
    public_key = None
    if address.startswith("tcp://"):
        try:
            require_curve()
        except BaseException:
            sock.close(linger=0)
            raise
        if secret_key is None:
            public, secret = zmq.curve_keypair()
        else:
            secret = z85.encode(bytes.fromhex(secret_key))
            public = zmq.curve_public(secret)
        sock.curve_server = True
        sock.curve_secretkey = secret
        public_key = z85.decode(public).hex()
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise HwsyncError(f"cannot bind the control endpoint {address}: {exc}; pick a free port or another "
                          "address") from None
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT), public_key


def connect_control(ctx: zmq.Context, endpoint: Endpoint, *, linger_s: float = ERROR_LINGER_S
                    ) -> tuple[zmq.Socket, ConnectionWatch]:
    """A DEALER connected to `endpoint` (a CURVE client on tcp://) and the watch of its connection."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_SENDER_FRAME_BYTES)
    if endpoint.address.startswith("tcp://"):
        if endpoint.server_key is None:
            sock.close(linger=0)
            raise ValueError(f"a tcp:// endpoint needs the sender's key: {endpoint.address}#TOKEN#KEY")
        require_curve()
        public, secret = zmq.curve_keypair()  # ephemeral: the token, not this key, says who we are
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = z85.encode(bytes.fromhex(endpoint.server_key))
    watch = ConnectionWatch(sock, endpoint.address)
    sock.connect(endpoint.address)
    return sock, watch


class _SocketMonitor:
    """A socket's ZeroMQ monitor for `events`, pollable, closed before the socket."""

    def __init__(self, sock: zmq.Socket, events: int) -> None:
        self._sock = sock
        # a name of its own: pyzmq's default is made from the socket's fd, which a socket opened right after
        # this one closed may reuse while the old monitor's inproc name is still taken
        self._monitor: zmq.Socket | None = sock.get_monitor_socket(
            events, addr=f"inproc://hwsync-monitor-{secrets.token_hex(8)}")

    def fileno_or_socket(self) -> zmq.Socket:
        """The monitor socket, readable when an event arrived."""
        assert self._monitor is not None
        return self._monitor

    def close(self) -> None:
        """Stop monitoring (before the socket closes); safe to call twice."""
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None


class ConnectionWatch(_SocketMonitor):
    """The monitor of a connecting socket: raises once the connection to the bound side is gone."""

    def __init__(self, sock: zmq.Socket, address: str) -> None:
        super().__init__(sock, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        self.address = address
        self.connected = False
        self.gone: str | None = None

    def check(self, what: str) -> None:
        """Read the events so far; SyncTimeoutError when the peer went away, ProtocolError for a failed handshake."""
        monitor = self._monitor
        while monitor is not None and monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            elif event & _HANDSHAKE_FAILED or (event == zmq.EVENT_DISCONNECTED and not self.connected):
                raise ProtocolError(
                    f"the handshake with {self.address} failed while {what}: the endpoint's key or token is not "
                    "that sender's, or another program listens there; pass sender.endpoint as it is")
            elif event == zmq.EVENT_DISCONNECTED:
                self.gone = what
        if self.gone is not None:  # a SyncTimeoutError, as for a same-host peer process found gone
            raise SyncTimeoutError(f"the connection to {self.address} closed while {what}: the other side exited or "
                                   "was closed (check its log)")

def unix_peer_pid(fd: int) -> int | None:
    """The pid of the process at the other end of the unix socket `fd` (SO_PEERCRED), or None (not one, or gone)."""
    try:
        with socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_STREAM) as peer:  # a dup: the original stays ZeroMQ's
            if peer.family != socket.AF_UNIX:
                return None
            pid, _uid, _gid = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   struct.calcsize("3i")))
            return pid or None
    except OSError:
        return None


class ConnectionLog(_SocketMonitor):
    """The monitor of a bound socket: logs the connections ZeroMQ dropped or refused (never raises).

    On ipc:// it also learns each connection's process (SO_PEERCRED) and keeps the pids of processes
    whose connection closed because they died (`deaths`): a receiver killed before it said Ready
    never told its pid any other way.
    """

    def __init__(self, sock: zmq.Socket, where: str) -> None:
        super().__init__(sock, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        self.where = where
        self._last: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._pids: dict[int, int] = {}  # a connection's fd -> its process, on ipc://
        #: processes whose connection closed with them dead, in order, not yet taken
        self.deaths: list[int] = []

    def check(self, what: str = "") -> None:
        """Log the events so far: accepted connections (debug), dropped ones, failed handshakes."""
        monitor = self._monitor
        while monitor is not None and monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(monitor)
            kind = event["event"]
            if kind == zmq.EVENT_ACCEPTED:
                pid = unix_peer_pid(event["value"])
                if pid is not None:
                    self._pids[event["value"]] = pid
                log.debug("hwsync: %s accepted a connection (fd %s, pid %s)", self.where, event["value"], pid)
            elif kind & _HANDSHAKE_FAILED:
                self._note("handshake", logging.WARNING, "refused a connection that failed the handshake (a tcp:// "
                           "peer without the endpoint's CURVE key, or not a ZeroMQ peer)")
            elif kind == zmq.EVENT_DISCONNECTED:
                pid = self._pids.pop(event["value"], None)
                if pid is not None and not peer_alive(pid, socket.gethostname()):
                    self.deaths.append(pid)
                self._note("closed", logging.INFO, "lost a connection: a peer left, or ZeroMQ dropped one that "
                           "sent a message over the protocol's limit (hwsync.protocol)")

    def _note(self, key: str, level: int, text: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1
        now = time.monotonic()
        if now - self._last.get(key, -DROP_LOG_INTERVAL_S) >= DROP_LOG_INTERVAL_S:
            count, self._counts[key] = self._counts[key], 0
            log.log(level, "hwsync: %s %s%s", self.where, text, f" ({count} times)" if count > 1 else "")
            self._last[key] = now


def peer_address(part: Any) -> str:
    """The remote address of the connection a zmq.Frame came from ("" where the transport has none)."""
    try:
        return part.get("Peer-Address") or ""
    except (AttributeError, zmq.ZMQError):
        return ""


#: a drop's reason is cut to this many characters in the log (it names what a stranger sent)
MAX_DROP_REASON_CHARS = 400


class DropLog:
    """Logs dropped frames per peer: the first at once, then one line with a count every DROP_LOG_INTERVAL_S."""

    #: peers remembered at most (a stranger that reconnects again and again gets a new identity each time)
    MAX_PEERS = 256

    def __init__(self, where: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.where = where
        self._clock = clock
        self._peers: OrderedDict[bytes, list[float]] = OrderedDict()  # identity -> [dropped since logged, when]
        #: every frame dropped so far (tests and `hwsync info` read it)
        self.total = 0

    def drop(self, identity: bytes, address: str, reason: str) -> None:
        """Count one dropped frame from `identity` and log it unless that peer was logged recently."""
        self.total += 1
        now = self._clock()
        entry = self._peers.pop(identity, None) or [0, -DROP_LOG_INTERVAL_S]
        self._peers[identity] = entry
        while len(self._peers) > self.MAX_PEERS:
            self._peers.popitem(last=False)
        entry[0] += 1
        if now - entry[1] >= DROP_LOG_INTERVAL_S:
            more = f" ({int(entry[0]) - 1} more dropped since the last report)" if entry[0] > 1 else ""
            # reason: built from the peer's values through protocol.fields.short, cut again here as a bound
            log.warning("hwsync: %s dropped a frame from peer %s%s: %s%s", self.where, identity.hex()[:64],
                        f" at {address}" if address else "", reason[:MAX_DROP_REASON_CHARS], more)
            entry[0], entry[1] = 0, now


# -- the gate of a bound control socket: who presented the token, and the check of every message -----------
log = logging.getLogger("hwsync")

#: reply(identity, frame): send one frame to one peer, never blocking
Reply = Callable[[bytes, Frame], None]


class Gate:
    """Admits the messages of one bound socket (see the module docstring)."""

    def __init__(self, token: str, ready: type[Frame], frames: dict[str, type[Frame]],
                 reply: Reply, *, names: tuple[str, str] = ("receiver", "sender")) -> None:
        self._names = names  # (what a peer is, what this side is), for messages
        self._token = token
        self._ready = {ready.T: ready}
        self._frames = frames
        self._reply = reply
        self.bound: set[bytes] = set()
        #: identities trusted once and let go (a peer of an aborted sync, one that left): their late frames are
        #: still dropped, but quietly: they are no stranger's
        self._left: OrderedDict[bytes, None] = OrderedDict()
        self.drops = DropLog(f"the {names[1]}")
        #: reasons of refusals that mean the deployment is wrong, since the owner last looked
        self.fatal: list[str] = []

    def admit(self, parts: list[zmq.Frame]) -> tuple[bytes, Frame] | None:
        """(identity, frame) of a checked message: a Ready with the token, or a bound identity's frame; else None."""
        identity = parts[0].bytes
        if len(parts) != 2:
            self.drops.drop(identity, peer_address(parts[0]), f"a message of {len(parts) - 1} parts, not one frame")
            return None
        data, bound = parts[1].buffer, identity in self.bound
        try:
            frame = decode(data, self._frames if bound else self._ready)
        except BadFrame as exc:
            if not bound and self._refuse_other_version(identity, data):
                return None
            if not bound and identity in self._left:
                log.debug("hwsync: the %s dropped a late frame from a %s it no longer trusts (it left, or its sync "
                          "was aborted): %s", self._names[1], self._names[0], str(exc)[:MAX_DROP_REASON_CHARS])
                return None
            self.drops.drop(identity, peer_address(parts[1]),
                            str(exc) if bound else f"{exc}, from a peer that never presented the token")
            return None
        if frame.T in self._ready and not _same(getattr(frame, "token", ""), self._token):
            self.drops.drop(identity, peer_address(parts[1]), "a ready frame with a wrong token")
            return None
        if frame.T in self._ready and getattr(frame, "proto", None) != PROTOCOL_VERSION:
            self._refuse_version(identity, getattr(frame, "proto", None), getattr(frame, "pid", None))
            return None
        return identity, frame

    def _refuse_other_version(self, identity: bytes, data: memoryview) -> bool:
        """Refuse a Ready of another protocol version that carries the token; False if it is not one.

        The map is read raw (any version may be told why), so every value is type-checked before it
        is looked up or compared: a stranger's `t` may be a map, its `token` a list.
        """
        raw = peek(data)  # scalars only: nothing in it is unhashable
        if raw is None or type(raw.get("t")) is not str or raw["t"] not in self._ready:
            return False
        token = raw.get("token")
        if type(token) is not str or not _same(token, self._token):
            return False
        if raw.get("proto") == PROTOCOL_VERSION:
            return False  # this version, merely malformed: dropped as such
        self._refuse_version(identity, raw.get("proto"), raw.get("pid"))
        return True

    def _refuse_version(self, identity: bytes, proto: object, pid: object) -> None:
        peer, own = self._names
        self.refuse(identity, f"the {peer} (pid {short(pid)}) speaks hwsync protocol {short(proto)} and this {own} "
                              f"speaks {PROTOCOL_VERSION}; install the same hwsync version on both sides", fatal=True)

    def bind(self, identity: bytes) -> None:
        """Trust `identity` from now on, and answer Welcome (this process's pid and host) at once."""
        self.bound.add(identity)
        self._reply(identity, Welcome(pid=os.getpid(), host=socket.gethostname()))

    def unbind(self, identity: bytes) -> None:
        """Trust `identity` no more (a peer that left, or reconnected under a new identity)."""
        if identity in self.bound:
            self._left[identity] = None
            while len(self._left) > DropLog.MAX_PEERS:
                self._left.popitem(last=False)
        self.bound.discard(identity)

    def refuse(self, identity: bytes, reason: str, *, fatal: bool) -> None:
        """Answer Refused with `reason`; `fatal` ones are kept for the owner to raise."""
        log.warning("hwsync: the %s refused a %s: %s", self._names[1], self._names[0], reason)
        self.unbind(identity)
        self._reply(identity, Refused(reason=cut(reason)))
        if fatal:
            self.fatal.append(reason)

    def take_fatal(self) -> str | None:
        """The first fatal refusal since the last call (the rest are logged already), or None."""
        reasons, self.fatal = self.fatal, []
        return reasons[0] if reasons else None


def _same(token: str, expected: str) -> bool:
    """Whether a peer's token is the expected one, in time that does not depend on where they differ."""
    return hmac.compare_digest(token.encode(), expected.encode())


def reply_on(sock_of: Callable[[], zmq.Socket | None]) -> Reply:
    """A Reply on the socket `sock_of()` returns (nothing once it is closed)."""

    def reply(identity: bytes, frame: Frame) -> None:
        sock = sock_of()
        if sock is not None and not sock.closed:
            try:
                sock.send_multipart([identity, encode(frame)], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a peer that cannot take a reply now is one that went away

    return reply
