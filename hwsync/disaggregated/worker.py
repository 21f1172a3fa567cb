"""CollectiveWorker: a thread that runs one group's collective calls, so no main thread ever blocks in one.

Collective calls block, and a broadcast whose peer died can block until the group's own
timeout. Each group's calls therefore run in order on a worker thread, which signals each
completion through a pipe that the owner polls together with its ZeroMQ socket (zmq.Poller
accepts any object with fileno()). The thread runs on the device of the thread that made the
worker (a new thread starts on device 0): the group is built there, and each call's
synchronization waits for that device.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from hwsync.backend.devices import DeviceOwner
from hwsync.backend.interfaces import Device
from hwsync.timing import WORKER_JOIN_S

Result = tuple[Any, Any, str | None]  # (tag, value, error message or None)


class CollectiveWorker:
    """A daemon thread that runs one group's collective calls in order and reports each outcome."""

    def __init__(self, name: str, device: Device) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._device = device
        self._owner = DeviceOwner(device)  # the creating thread's device, made current in the worker
        self._failed: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable whenever a result is waiting (zmq.Poller polls it next to a socket)."""
        return self._read_fd

    def submit(self, tag: Any, call: Callable[..., Any], *args: Any) -> None:
        """Queue `call(*args)`; its result comes back from results() under `tag`."""
        self._jobs.put((tag, call, args))

    def _run(self) -> None:
        try:
            self._owner.enter()
            while (job := self._jobs.get()) is not None:
                tag, call, args = job
                if self._failed is not None:  # a group that failed once is never trusted again
                    self._results.put((tag, None, self._failed))
                else:
                    try:
                        value = call(*args)
                        # the bytes must be in (or out of) the buffer before the main thread touches it
                        self._device.synchronize()
                        self._results.put((tag, value, None))
                    except BaseException as exc:  # noqa: BLE001 - reported to the main thread
                        self._failed = f"{type(exc).__name__}: {exc}"
                        self._results.put((tag, None, self._failed))
                os.write(self._write_fd, b"x")
        except OSError:
            pass  # the owner stopped listening (closed the pipe): nothing left to report to
        finally:
            os.close(self._write_fd)

    def results(self) -> list[Result]:
        """Every result that has arrived, in order."""
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def stop(self, join_s: float = WORKER_JOIN_S) -> bool:
        """Finish queued work and end the thread; False if it is stuck in a collective (it is abandoned)."""
        self._jobs.put(None)
        self._thread.join(join_s)
        alive = self._thread.is_alive()
        if self._read_fd >= 0:
            os.close(self._read_fd)  # a stuck thread's last write then fails, and it closes its end
            self._read_fd = -1
        return not alive
