"""The gate of a bound control socket: who presented the token, and the check of every message.

Anyone who can reach a sender's (or hub's) address can connect and send bytes. The gate lets
through only:
- a Ready (RankReady) of this protocol version that carries the token, from anyone: its owner
  then binds that connection's ZeroMQ identity (`bind`, answering Welcome) or refuses it with
  the reason (`refuse`, answering Refused);
- frames the socket accepts (protocol.TO_SENDER, TO_HUB) from a bound identity.
Every message is checked against the protocol first (one part, a defined frame, each field of
its type); anything else, and every frame of an identity that is not bound, is dropped and
logged (DropLog: naming the identity and address, rate-limited). A Ready of another protocol
version is read raw, and refused with the reason when it carries the token.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
from collections.abc import Callable

import zmq

from hwsync.protocol import PROTOCOL_VERSION, BadFrame, Frame, Refused, Welcome, decode, encode, peek
from hwsync.protocol.fields import short
from hwsync.protocol.limits import cut
from hwsync.sockets import DropLog, peer_address

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
