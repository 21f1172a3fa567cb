"""What the parts of the bed share (hosts.py, spawn.py): its errors, the collective libraries' interface variables."""

from __future__ import annotations


class BedError(RuntimeError):
    """A bed command failed; the message carries the command and what `ip`/`tc` said."""


class BedUnavailableError(BedError):
    """This machine cannot hold a bed (not root, no `ip`, namespaces refused); the message says which."""


#: the collective libraries' interface variables (Bed.env sets them; start(interface_vars=False) leaves them out)
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "HCCL_IF_IP", "TP_SOCKET_IFNAME")
