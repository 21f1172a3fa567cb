"""The engine's side of the edge: what a receiver hands a sync's tensors to, as one object.

A `Loader` loads each bucket's complete tensors; it may also name destinations to copy straight into
(`into`), check the announced manifest and begin the sync before any byte moves (`accept`: raise to refuse
it, which the sender is told), and end it after the last tensor (`done`). A receiver that stages applies
a committed version inside the loader's `pause()` (a context manager: the engine's safe point), if any.
A loader may stage on its own instead (a StagedForwarder into an engine that stages): its `done()` returns
once what it was given is staged and verified, `commit()` applies it once every receiver of the sync staged
it, and `abandon()` drops it when the sync fails before that (CrossNodeReceiver calls them).
A receiver takes one object, `receive(loader, state=...)`; a plain load function works too, and `into=`
names destinations for either.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from hwsync.sync.bucket import IntoFn, LoadFn
from hwsync.sync.spec import TensorSpec

#: accept(version, manifest): the sync is announced, no byte has moved; raise to refuse it (the sender is told)
AcceptFn = Callable[[int, "list[TensorSpec] | None"], None]


@runtime_checkable
class Loader(Protocol):
    """Takes a sync's tensors on the engine's side. Optional, found by name: `into(name, dtype, shape)`,
    `accept(version, manifest)`, `done()`, `pause()`, and together `commit()` and `abandon()`."""

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Each bucket's complete (name, tensor) pairs: views valid during the call only (copy what you keep)."""
        ...


@dataclass(frozen=True)
class Hooks:
    """A receiver's calls into the engine for one sync, from whatever the caller passed."""

    load: LoadFn | None
    into: IntoFn | None
    accept: AcceptFn | None
    done: Callable[[], None] | None
    #: a staging receiver applies a committed version inside this context (the engine's pause), when given
    pause: Callable[[], AbstractContextManager[object]] | None = None
    #: a loader that stages on its own: apply what done() staged (every receiver staged it) ...
    commit: Callable[[], None] | None = None
    #: ... or drop it (the sync failed before the commit)
    abandon: Callable[[], None] | None = None

    @classmethod
    def of(cls, loader: Loader | LoadFn | None, into: IntoFn | None) -> Hooks:
        """From a Loader object (its optional methods where it has them) or a load function, and `into=`."""
        if loader is None or not isinstance(loader, Loader):
            if loader is not None and not callable(loader):
                raise TypeError(f"receive() takes a Loader (an object with load()) or a load function, got "
                                f"{type(loader).__name__}")
            hooks = cls(loader, into, None, None)
        else:
            hooks = cls(loader.load, into or _optional(loader, "into"), _optional(loader, "accept"),
                        _optional(loader, "done"), _optional(loader, "pause"), _optional(loader, "commit"),
                        _optional(loader, "abandon"))
            if (hooks.commit is None) != (hooks.abandon is None):
                raise TypeError(f"{type(loader).__name__} has {'commit' if hooks.commit else 'abandon'}() but not "
                                f"{'abandon' if hooks.commit else 'commit'}(): a loader that stages on its own needs "
                                "both (commit applies what it staged, abandon drops it)")
        if hooks.load is None and hooks.into is None:
            raise ValueError("receive() needs load (called with each bucket's tensors), into (naming "
                             "destination tensors), or both")
        return hooks


def _optional(loader: Any, name: str) -> Any:
    method = getattr(loader, name, None)
    return method if callable(method) else None
