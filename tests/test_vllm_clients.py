"""The vLLM client adapters' contract with hwsync's trainer side, without an engine: a prefix-cache reset vLLM refuses
(it does while running requests hold KV blocks) is said, not swallowed."""

from __future__ import annotations

import logging

import pytest

from hwsync.integrations.vllm.clients import can_pause, reset_prefix_cache


class _Client:
    """A client whose engine answers the reset with `answer` (vLLM's bool)."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer

    def reset_prefix_cache(self) -> bool:
        return self.answer


def test_a_refused_prefix_cache_reset_is_said(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="hwsync"):
        assert reset_prefix_cache(_Client(True)) is True
        assert not caplog.records
        assert reset_prefix_cache(_Client(False)) is False
    (record,) = caplog.records
    assert "kept its prefix cache after the sync" in record.getMessage()
    assert "pause_mode='wait' or 'abort'" in record.getMessage()  # and what to do about it


def test_which_clients_can_pause_their_engine():
    class Pauses:
        def pause_generation(self, mode: str) -> None: ...

    class Http:
        base_url = "http://127.0.0.1:8000"

    assert can_pause(Pauses()) and can_pause(Http()) and not can_pause(_Client(True))
