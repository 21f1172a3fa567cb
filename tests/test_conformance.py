"""Every registered backend implements the whole interface, whether or not its hardware is here."""

import inspect

import pytest

from hwsync.backend.interfaces import Backend, Device, ProbeResult, Transport
from hwsync.backend.registry import installed_names, load_backend


def _abstract_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if getattr(v, "__isabstractmethod__", False)}


@pytest.mark.parametrize("name", installed_names())
def test_backend_implements_everything(name):
    backend = load_backend(name)  # must import and instantiate on any machine
    assert isinstance(backend, Backend) and backend.name == name
    assert not inspect.isabstract(type(backend))
    device = backend.device()
    assert isinstance(device, Device) and not inspect.isabstract(type(device))
    for attr in ("name", "torch_type"):
        assert isinstance(getattr(device, attr), str)
    probe = backend.probe()
    assert isinstance(probe, ProbeResult) and probe.reason, "a probe must always say why"
    transports = backend.transports()
    assert transports, "a backend offers at least one transport"
    for tname, transport in transports.items():
        assert isinstance(transport, Transport) and transport.name == tname
        assert not inspect.isabstract(type(transport))
        assert isinstance(transport.available(), ProbeResult)
        assert transport.default_bucket_bytes >= 1 << 20
    assert callable(backend.communicator)


def test_interface_lists_are_what_we_check():
    assert _abstract_methods(Device) >= {"probe", "mem_get_info", "physical_id", "synchronize"}
    assert _abstract_methods(Transport) == {"available", "open_sender", "open_receiver"}
