"""What the parts of the bed share (hosts.py, spawn.py, stream.py): its errors, the collective libraries' interface
variables, where the hwsync package is."""

from __future__ import annotations

import importlib.util
import os
import sys


class BedError(RuntimeError):
    """A bed command failed; the message carries the command and what `ip`/`tc` said."""


class BedUnavailableError(BedError):
    """This machine cannot hold a bed (not root, no `ip`, namespaces refused); the message says which."""


#: the collective libraries' interface variables (Bed.env sets them; start(interface_vars=False) leaves them out)
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "HCCL_IF_IP", "TP_SOCKET_IFNAME")


def hwsync_package() -> str:
    """The folder of the hwsync package this process imported, or else would import, found without importing it.

    A host process loads some of its modules by path (hwsync/timing.py), since importing the package imports torch.
    """
    origin = getattr(sys.modules.get("hwsync"), "__file__", None)
    if origin is None:
        spec = importlib.util.find_spec("hwsync")
        origin = spec.origin if spec is not None else None
    if origin is None:
        raise BedError("the hwsync package is not importable here: install the core next to the tools "
                       "(pip install -e . -e tools)")
    return os.path.dirname(os.path.abspath(origin))
