"""The control plane's sockets: endpoints and tokens, and waits with a timeout and a liveness check.

The sender binds a ZeroMQ ROUTER socket; receivers connect DEALER sockets. What travels on
them is defined in hwsync.protocol. An ipc:// endpoint lives in a private 0700 directory;
every endpoint carries a random token that receivers must present.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass

import zmq

from hwsync.errors import SyncTimeout
from hwsync.timing import LIVENESS_SLICE_S


@dataclass(frozen=True)
class Endpoint:
    """A bindable address plus the token receivers must present."""

    address: str
    token: str

    def __str__(self) -> str:
        return f"{self.address}#{self.token}"

    @classmethod
    def parse(cls, text: str) -> "Endpoint":
        """Split "ADDRESS#TOKEN" as produced by WeightSender.endpoint."""
        address, sep, token = text.rpartition("#")
        if not sep or not address.startswith(("ipc://", "tcp://")):
            raise ValueError(
                f"endpoint {text!r} is not one a WeightSender printed; pass sender.endpoint as it is "
                "(ipc://PATH#TOKEN or tcp://HOST:PORT#TOKEN)"
            )
        return cls(address, token)


def private_ipc_dir() -> str:
    """A fresh directory only this user can enter, for ipc:// socket files."""
    path = tempfile.mkdtemp(prefix="hwsync-")
    os.chmod(path, 0o700)
    return path


def remove_ipc_dir(address: str) -> None:
    """Remove the private directory of an ipc:// address made by private_ipc_dir (never another)."""
    if address.startswith("ipc://"):
        directory = os.path.dirname(address[len("ipc://"):])
        if os.path.basename(directory).startswith("hwsync-"):
            shutil.rmtree(directory, ignore_errors=True)


def peer_alive(pid: int | None, host: str | None) -> bool:
    """False only when the peer runs on this host and its process is gone (or a zombie)."""
    if not pid or host != socket.gethostname():
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


def new_token() -> str:
    """A random shared token."""
    return secrets.token_hex(16)


def timeout_error(timeout_s: float, what: str, endpoint: str) -> SyncTimeout:
    """The error every wait raises at its deadline, naming the phase and the endpoint."""
    return SyncTimeout(
        f"timed out after {timeout_s:.1f}s {what} (endpoint {endpoint}); the peer is dead, stalled "
        "or never started. Check the other side's log, or raise timeout_s for slow peers."
    )


def raise_if_exited(peers: list[tuple[int | None, str | None]], *, what: str, endpoint: str) -> None:
    """Raise SyncTimeout naming the first same-host peer process that no longer exists."""
    for pid, host in peers:
        if not peer_alive(pid, host):
            raise SyncTimeout(f"peer process {pid} exited {what} (endpoint {endpoint})")


def receive_frame(
    sock: zmq.Socket, timeout_s: float, *, what: str, endpoint: str, peers: list[tuple[int | None, str | None]] = ()
) -> list[bytes]:
    """Wait for one multipart message, or raise SyncTimeout naming the phase and endpoint."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise timeout_error(timeout_s, what, endpoint)
        if sock.poll(int(min(left, LIVENESS_SLICE_S) * 1000), zmq.POLLIN):
            return sock.recv_multipart()
        raise_if_exited(list(peers), what=what, endpoint=endpoint)
