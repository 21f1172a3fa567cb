"""The control plane's endpoints and waits: tokens, keys, and waits with a timeout and liveness checks.

The sender binds a ZeroMQ ROUTER socket; receivers connect DEALER sockets (hwsync.control.sockets makes
both). What travels on them is defined in hwsync.protocol. An endpoint string carries all a
receiver needs: the address, a random token it must present, and for tcp:// the sender's CURVE
public key (the channel is encrypted and the sender authenticated):

    ipc://PATH#TOKEN                 a socket file in a private 0700 directory (one host)
    tcp://HOST:PORT#TOKEN#KEY        KEY: the sender's CURVE public key, 64 hex digits

A wait returns a frame, or raises: at its deadline (SyncTimeoutError naming the phase), when a
same-host peer process is gone, when the connection closed, or when close() was called from
another thread (ClosedError).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import zmq

from hwsync.backend.owners import IPC_DIR_NAME, own_entry, owner_prefix, sweep_dead_owners
from hwsync.errors import ClosedError, SyncTimeoutError
from hwsync.timing import CLOSE_GRACE_S, LIVENESS_SLICE_S

log = logging.getLogger("hwsync")

_FORMATS = "ipc://PATH#TOKEN, or tcp://HOST:PORT#TOKEN#KEY"
_HEX_KEY = re.compile(r"[0-9a-f]{64}")


def redacted(endpoint: str) -> str:
    """An endpoint string fit for a log: the address, each secret part (token, key) replaced by '#...'."""
    if endpoint.startswith("ipc://"):
        address, sep, _ = endpoint.rpartition("#")
        return f"{address}#..." if sep else endpoint
    address, *secrets_ = endpoint.split("#")
    return address + "#..." * len(secrets_)


@dataclass(frozen=True, repr=False)
class Endpoint:
    """A bindable address, the token receivers must present and, for tcp://, the sender's CURVE public key."""

    address: str
    token: str
    #: the bound side's CURVE public key, 64 hex digits (tcp:// only)
    server_key: str | None = None

    def __str__(self) -> str:
        """The whole endpoint string, secrets included: what a receiver connects with. Never log it."""
        return f"{self.address}#{self.token}" + (f"#{self.server_key}" if self.server_key else "")

    def __repr__(self) -> str:
        return f"Endpoint({redacted(str(self))!r})"

    @classmethod
    def parse(cls, text: str) -> "Endpoint":
        """Split an endpoint string as a WeightSender or CrossNodeSender printed it (see the module doc)."""
        if text.startswith("ipc://"):
            address, sep, token = text.rpartition("#")  # a socket path may itself hold a '#'
            if sep and token:
                return cls(address, token)
        elif text.startswith("tcp://"):
            parts = text.split("#")
            if len(parts) == 2:
                raise ValueError(f"endpoint {redacted(text)!r} has no CURVE key: tcp:// endpoints carry the sender's "
                                 f"public key since hwsync protocol 4; pass sender.endpoint as it is ({_FORMATS})")
            if len(parts) == 3 and parts[1] and _HEX_KEY.fullmatch(parts[2]):
                return cls(parts[0], parts[1], parts[2])
        raise ValueError(f"endpoint {redacted(text)!r} is not one a WeightSender printed; pass sender.endpoint as it "
                         f"is ({_FORMATS})")


def private_ipc_dir() -> str:
    """A fresh directory only this user can enter, for ipc:// socket files, named after this process (owner_prefix)."""
    sweep_dead_owners()
    path = tempfile.mkdtemp(prefix=owner_prefix())
    os.chmod(path, 0o700)
    return path


def remove_ipc_dir(address: str, owner_pid: int | None = None) -> None:
    """Remove the private directory of an ipc:// address made by private_ipc_dir (of process `owner_pid`, if given).

    Never another path: the directory must be one private_ipc_dir names (in the temp directory, an
    owner prefix and mkdtemp's suffix), a real directory (not a link) of this user. A receiver calls
    this with an address its caller gave, for a sender found dead.
    """
    if not address.startswith("ipc://"):
        return
    directory = os.path.dirname(address[len("ipc://"):])
    match = IPC_DIR_NAME.fullmatch(os.path.basename(directory))
    if match is None or (owner_pid is not None and int(match.group(1)) != owner_pid):
        return
    if os.path.realpath(os.path.dirname(directory)) != os.path.realpath(tempfile.gettempdir()):
        return
    if own_entry(directory, stat.S_ISDIR):
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


def timeout_error(timeout_s: float, what: str, endpoint: str) -> SyncTimeoutError:
    """The error every wait raises at its deadline, naming the phase and the endpoint."""
    return SyncTimeoutError(
        f"timed out after {timeout_s:.1f}s {what} (endpoint {endpoint}); the peer is dead, stalled "
        "or never started. Check the other side's log, or raise timeout_s for slow peers."
    )


def raise_if_exited(peers: Sequence[tuple[int | None, str | None]], *, what: str, endpoint: str) -> None:
    """Raise SyncTimeoutError naming the first same-host peer process that no longer exists."""
    for pid, host in peers:
        if not peer_alive(pid, host):
            raise SyncTimeoutError(f"peer process {pid} exited {what} (endpoint {endpoint})")


class Watch(Protocol):
    """Something a wait polls besides its socket, which raises once it has something to say."""

    def fileno_or_socket(self) -> int | zmq.Socket:
        """What to poll: a file descriptor or a ZeroMQ socket."""

    def check(self, what: str) -> None:
        """Raise if what it watches calls for ending the wait (`what` names the phase)."""


class CloseSignal:
    """close() called from another thread: a flag checked between steps, and a pipe that wakes a wait at once.

    ZeroMQ sockets belong to one thread, so close() never touches the socket of a running sync:
    it sets this, and the thread running the sync raises ClosedError, sends its abort and ends.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        #: where close() was called from, for the message: "from another thread", or from the call's own code
        self.whence = "from another thread"
        self._event = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def set(self, whence: str | None = None) -> None:
        """Ask the running sync (if any) to end; safe from any thread, and to call twice."""
        if not self._event.is_set():
            if whence is not None:
                self.whence = whence
            self._event.set()
            try:
                os.write(self._write, b"x")
            except OSError:
                pass

    def is_set(self) -> bool:
        """Whether close() was called."""
        return self._event.is_set()

    def fileno_or_socket(self) -> int:
        """The pipe's read end, readable once set."""
        return self._read

    def check(self, what: str) -> None:
        """Raise ClosedError once close() was called."""
        if self._event.is_set():
            raise ClosedError(f"the {self.who} was closed (close() called {self.whence}) while {what}")

    def close(self) -> None:
        """Release the pipe (once nothing waits on it any more)."""
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1


class Lifetime:
    """A sender's or receiver's calls and its close(), from any thread.

    One call at a time; ClosedError for any call after close(). close() from another thread
    during a call sets the close signal, so the call's own thread ends it (sending the abort
    or error its peers hear at once) and then waits for it; the resources are released by
    whichever of the two finishes last. A call stuck in the caller's own code (a source that
    does not yield) is given CLOSE_GRACE_S; it then releases them itself when it returns.
    """

    def __init__(self, who: str, release: Callable[[], None]) -> None:
        self.who = who
        self.signal = CloseSignal(who)
        self._release = release
        self._lock = threading.Lock()
        self._running: int | None = None  # the thread inside a call, if any
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._released = False

    @contextmanager
    def call(self, name: str) -> Iterator[None]:
        """Run one call (`name`, for messages): refused after close() and while another runs."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"this {self.who} is closed; make a new one to {name} again")
            if self._running is not None:
                raise RuntimeError(f"{name}() is already running in another thread; one at a time per {self.who}")
            self._running = threading.get_ident()
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._running = None
                self._idle.set()
                release = self._closed  # close() came meanwhile and left the release to this thread
            if release:
                self._release_once()

    def close(self) -> None:
        """End a running call (from another thread, or from the call's own code: a source or load that closes)
        and release the resources; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running = self._running not in (None, threading.get_ident())
            inside = self._running == threading.get_ident()
        if inside:
            # close() from inside the call (its source, its load): the call is still using the resources, so it
            # ends at its next check with ClosedError and releases them as it returns (call()'s finally)
            self.signal.set("from inside the call, on its own thread")
            return
        self.signal.set()
        if running and not self._idle.wait(CLOSE_GRACE_S):
            with self._lock:
                if self._running is not None:
                    log.warning("hwsync: close() left the running call of this %s to end by itself: it is in the "
                                "caller's code (a source or load), and ends when that returns", self.who)
                    return
        self._release_once()

    def _release_once(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        try:
            self._release()
        finally:
            self.signal.close()


def receive_frame(
    sock: zmq.Socket, timeout_s: float, *, what: str, endpoint: str,
    peers: Sequence[tuple[int | None, str | None]] = (), watches: Sequence[Watch] = (),
    deadline: float | None = None, copy: bool = True,
) -> list:
    """Wait for one multipart message, or raise SyncTimeoutError naming the phase and endpoint.

    `deadline` (time.monotonic()) lets a caller that skips some messages keep one deadline for
    the whole wait; `watches` (a close signal, a connection monitor) are polled with the socket.
    `copy=False` returns zmq.Frame parts (with their connection's metadata).
    """
    for watch in watches:
        if isinstance(watch, CloseSignal):
            watch.check(what)
    if sock.poll(0, zmq.POLLIN):  # the common case: the frame is already there
        return sock.recv_multipart(0, copy)
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    for watch in watches:
        poller.register(watch.fileno_or_socket(), zmq.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise timeout_error(timeout_s, what, endpoint)
        ready = dict(poller.poll(int(min(left, LIVENESS_SLICE_S) * 1000)))
        if sock in ready:  # before the watches: what a peer sent before it went away (an abort) comes first
            return sock.recv_multipart(0, copy)
        for watch in watches:
            if watch.fileno_or_socket() in ready:
                watch.check(what)
        raise_if_exited(peers, what=what, endpoint=endpoint)
