"""Loaded by every Python process the test suite starts (tests/conftest.py puts this folder first on
PYTHONPATH): records the endpoint tokens the process makes and every hwsync log line it writes, so the
suite can check at its end that no token reached a log (tests/conftest.py, no_secret_in_any_message)."""

import json
import logging
import os
import secrets

_PATH = os.environ.get("HWSYNC_TEST_SECRET_LOG")


def _append(kind: str, text: str) -> None:
    line = (json.dumps({"kind": kind, "text": text[:4000]}) + "\n").encode()
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


if _PATH:
    _token_hex = secrets.token_hex

    def _recorded_token_hex(nbytes=None):
        value = _token_hex(nbytes)
        if nbytes == 16:  # an endpoint token (hwsync.control.endpoints.new_token); other ids are shorter
            _append("token", value)
        return value

    secrets.token_hex = _recorded_token_hex

    class _Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                _append("log", record.getMessage())
            except Exception:  # noqa: BLE001 - a record that cannot be formatted is not ours to fail on
                pass

    logging.getLogger("hwsync").addHandler(_Recorder())
