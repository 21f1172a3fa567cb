"""Which interface a rank uses (hwsync.control.nic) and how each library is told (gloo per group; NCCL/HCCL variables,
set only where the user did not); on this host, and inside bed hosts where the answer is known exactly."""

from __future__ import annotations

import logging
import os

import pytest

import bed_procs
from bed_procs import bed_or_skip
from hwsync.backend import communicator
from hwsync.control import nic
from hwsync.disaggregated.sender import choose_group_host, endpoint_host

PROCS = os.path.abspath(bed_procs.__file__)


def test_loopback_is_owned_and_routed_through_lo():
    lo = nic.nic_owning("127.0.0.1")
    if lo is None:
        pytest.skip("this platform cannot list its interfaces")
    assert lo.address == "127.0.0.1" and nic.nic_towards("127.0.0.1") == lo
    assert nic.nic_owning("127.0.1.1").name == lo.name  # a Debian hostname's address: lo's too
    assert nic.nic_owning("0.0.0.0") is None and nic.nic_owning("192.0.2.254") != lo


def test_group_host_is_checked_and_otherwise_taken_from_the_hub():
    assert endpoint_host("tcp://10.1.2.3:5#tok#key") == "10.1.2.3" and endpoint_host("tcp://*:0") is None
    assert endpoint_host("tcp://[::1]:7") == "::1" and endpoint_host("ipc:///tmp/x#t") is None
    assert choose_group_host(None, 0, "tcp://127.0.0.1:0") == "127.0.0.1"
    assert choose_group_host(None, 1, "tcp://127.0.0.1:9#t#k") == "127.0.0.1"  # the address that routes to the hub
    if nic.local_addresses() is not None:
        with pytest.raises(ValueError, match=r"group_host='10\.254\.254\.254' is not an address of this host \(its "
                                             r"addresses: .*lo 127\.0\.0\.1"):
            choose_group_host("10.254.254.254", 0, None)


def test_interface_variables_set_once_and_never_over_the_users(monkeypatch, caplog):
    monkeypatch.setattr(communicator, "_set_here", {})
    for name in ("HWTEST_IFNAME", "HWTEST_IP"):  # set, then removed: monkeypatch removes what the test sets too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    eth1 = nic.Nic("eth1", "10.0.0.2")
    with caplog.at_level(logging.INFO, logger="hwsync"):
        note = communicator.claim_interface_env("LIB", {"HWTEST_IFNAME": "=eth1", "HWTEST_IP": "10.0.0.2"}, eth1, "once")
    assert note == "set HWTEST_IFNAME==eth1, HWTEST_IP=10.0.0.2 for this process"
    assert os.environ["HWTEST_IFNAME"] == "=eth1" and "reads it once" in caplog.text
    # a later group on the same interface: nothing changes; on another: kept, with a warning (read once)
    assert "set by hwsync for an earlier group" in communicator.claim_interface_env(
        "LIB", {"HWTEST_IFNAME": "=eth1", "HWTEST_IP": "10.0.0.2"}, eth1, "once")
    caplog.clear()
    communicator.claim_interface_env("LIB", {"HWTEST_IFNAME": "=eth2", "HWTEST_IP": "10.0.1.2"},
                                     nic.Nic("eth2", "10.0.1.2"), "once")
    assert os.environ["HWTEST_IFNAME"] == "=eth1" and "keeps it" in caplog.text
    # the user's own value is never replaced, and a mismatch is said
    monkeypatch.setattr(communicator, "_set_here", {})
    monkeypatch.delenv("HWTEST_IP")
    monkeypatch.setenv("HWTEST_IFNAME", "=ib0")
    caplog.clear()
    note = communicator.claim_interface_env("LIB", {"HWTEST_IFNAME": "=eth1", "HWTEST_IP": "10.0.0.2"}, eth1, "once")
    assert note == "HWTEST_IFNAME==ib0 set by the user, kept" and os.environ["HWTEST_IFNAME"] == "=ib0"
    assert "HWTEST_IP" not in os.environ and "unset it to let hwsync choose" in caplog.text


def test_gloo_binds_the_interface_per_group_unless_the_user_named_one(monkeypatch):
    gloo = pytest.importorskip("hwsync_cpu.gloo")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    factory, note = gloo.gloo_factory(nic.Nic("lo", "127.0.0.1"))
    assert factory is not gloo.gloo_group and note == "gloo device bound to 127.0.0.1 for this group"
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # per group: the process environment is left alone
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert gloo.gloo_factory(nic.Nic("lo", "127.0.0.1")) == (gloo.gloo_group, "GLOO_SOCKET_IFNAME=eth7 set by the "
                                                                               "user, kept")


def test_inside_bed_hosts_the_owner_the_route_and_the_default():
    """In host 1 (its own name, no default route): the hub's address routes through hwbed1; a host name that does
    not resolve leaves the default to the one address that is not loopback; host 0's address is no one's here."""
    with bed_or_skip(2) as bed:
        seen = bed.start(1, f"{PROCS}:nics", bed.address(0), interface_vars=False).result(30)
    assert seen["towards"] == ["hwbed1", bed.address(1)]
    assert seen["owning"] is None and seen["pick"] == bed.address(1)
    assert seen["hostname"] == bed.hostname(1)
