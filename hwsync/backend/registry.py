"""Finding and selecting backends: stevedore over the `hwsync.backends` entry points.

- HWSYNC_BACKEND=<name> selects exactly that backend; it never falls back.
- unset or "auto" probes npu, then cuda, then cpu (then any third-party backend); a fallback
  to cpu is said in one short line (FALLBACK_LINE, a warning), once per process tree, and logged
  with every probe's reason at debug level (`hwsync info` shows them too); HWSYNC_STRICT=1 makes
  it an error that names every probe's reason.
- the resolved name is written back to HWSYNC_BACKEND so child processes agree (and, selecting
  it by name, say nothing).
Every failure raises BackendError listing the installed backends and each probe's reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from importlib.metadata import entry_points

from stevedore import DriverManager

from hwsync.backend.interfaces import Backend, ProbeResult
from hwsync.errors import BackendError

NAMESPACE = "hwsync.backends"
ENV_BACKEND = "HWSYNC_BACKEND"
ENV_STRICT = "HWSYNC_STRICT"
AUTO_ORDER = ("npu", "cuda", "cpu")
#: what a fallback to cpu says: one line, once; the reasons are for `hwsync info` and the debug log
FALLBACK_LINE = "hwsync: no usable GPU or NPU, using the cpu backend (`hwsync info` says why)"

log = logging.getLogger("hwsync")


@dataclass(frozen=True)
class BackendStatus:
    """An installed backend and what its probe (or its import) said."""

    name: str
    usable: bool
    reason: str
    distribution: str | None


@dataclass(frozen=True)
class Selection:
    """The chosen backend and why it was chosen."""

    backend: Backend
    reason: str
    statuses: list[BackendStatus]


def installed_names() -> list[str]:
    """Names registered under hwsync.backends, auto-probe order first, then alphabetical."""
    names = {ep.name for ep in entry_points(group=NAMESPACE)}
    return [n for n in AUTO_ORDER if n in names] + sorted(names - set(AUTO_ORDER))


def _distribution(name: str) -> str | None:
    for ep in entry_points(group=NAMESPACE, name=name):
        return ep.dist.name if ep.dist else None
    return None


def load_backend(name: str) -> Backend:
    """Import and instantiate one backend plugin (no probing)."""
    manager = DriverManager(NAMESPACE, name, invoke_on_load=True, on_load_failure_callback=_reraise)
    return manager.driver


def _reraise(manager: object, entrypoint: object, exc: BaseException) -> None:
    raise exc


def _status(name: str) -> tuple[Backend | None, BackendStatus]:
    dist = _distribution(name)
    try:
        backend = load_backend(name)
    except Exception as exc:  # noqa: BLE001 - a plugin that fails to import is reported, not fatal to the rest
        return None, BackendStatus(name, False, f"plugin failed to load: {type(exc).__name__}: {exc}", dist)
    try:
        result = backend.probe()
    except Exception as exc:  # noqa: BLE001 - a probe must not raise, but a third-party one might
        result = ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
    return backend, BackendStatus(name, result.usable, result.reason, dist)


def backend_statuses() -> list[BackendStatus]:
    """Load and probe every installed backend."""
    return [_status(name)[1] for name in installed_names()]


def _listing(statuses: list[BackendStatus]) -> str:
    if not statuses:
        return "  (none: install hwsync-cpu, e.g. `pip install -e backends/cpu`)"
    return "\n".join(f"  {s.name:8s} {'usable' if s.usable else 'not usable'}: {s.reason}" for s in statuses)


def select_backend(name: str | None = None, *, quiet: bool = False) -> Selection:
    """Select a backend by `name`, else by HWSYNC_BACKEND, else by probing; see module doc.

    `quiet`: a fallback to cpu is not announced (the caller reports `Selection.reason` itself, as `hwsync info`).
    """
    requested = (name or os.environ.get(ENV_BACKEND) or "auto").strip().lower()
    names = installed_names()
    if requested != "auto":
        return _select_exact(requested, names)
    return _select_auto(names, quiet)


def _select_exact(requested: str, names: list[str]) -> Selection:
    if requested not in names:
        statuses = backend_statuses()
        raise BackendError(
            f"{ENV_BACKEND}={requested}: no such backend is installed. Installed backends:\n"
            f"{_listing(statuses)}\nInstall the distribution hwsync-{requested}, or pick one above."
        )
    backend, status = _status(requested)
    if backend is None or not status.usable:
        statuses = [status if s.name == requested else s for s in backend_statuses()]
        raise BackendError(
            f"{ENV_BACKEND}={requested}: backend {requested!r} is not usable here: {status.reason}\n"
            f"Installed backends:\n{_listing(statuses)}\n"
            f"An explicit {ENV_BACKEND} never falls back; unset it (or set auto) to probe."
        )
    os.environ[ENV_BACKEND] = requested
    return Selection(backend, f"selected by {ENV_BACKEND}={requested}", backend_statuses_with(status))


def backend_statuses_with(known: BackendStatus) -> list[BackendStatus]:
    """Every installed backend's status, reusing one already probed."""
    return [known if n == known.name else _status(n)[1] for n in installed_names()]


_fallback_said = False


def _select_auto(names: list[str], quiet: bool) -> Selection:
    statuses: list[BackendStatus] = []
    chosen: tuple[Backend, BackendStatus] | None = None
    for name in names:
        backend, status = _status(name)
        statuses.append(status)
        if chosen is None and backend is not None and status.usable:
            chosen = (backend, status)
    if chosen is None:
        raise BackendError(f"no usable hwsync backend. Installed backends:\n{_listing(statuses)}")
    backend, status = chosen
    skipped = [s for s in statuses if s.name in AUTO_ORDER
               and AUTO_ORDER.index(s.name) < AUTO_ORDER.index(status.name)] if status.name in AUTO_ORDER else []
    if status.name == "cpu" and skipped:
        why = "; ".join(f"{s.name}: {s.reason}" for s in skipped)
        if os.environ.get(ENV_STRICT, "") not in ("", "0"):
            raise BackendError(
                f"{ENV_STRICT}=1 forbids falling back to cpu, and no accelerator backend is usable "
                f"({why}). Installed backends:\n{_listing(statuses)}"
            )
        log.debug("hwsync: falling back to the cpu backend (%s)", why)
        _say_fallback(quiet)
        reason = f"auto: fell back to cpu because {why}"
    else:
        reason = f"auto: {status.name} is the first usable backend in the order {', '.join(AUTO_ORDER)}"
    os.environ[ENV_BACKEND] = status.name
    return Selection(backend, reason, statuses)


def _say_fallback(quiet: bool) -> None:
    """The fallback's one line, once per process; children inherit HWSYNC_BACKEND=cpu and select it by name."""
    global _fallback_said
    if not quiet and not _fallback_said:
        _fallback_said = True
        log.warning(FALLBACK_LINE)


_current: Selection | None = None


def get_backend() -> Backend:
    """The process-wide backend, selected once (HWSYNC_BACKEND or auto)."""
    global _current
    wanted = os.environ.get(ENV_BACKEND)
    if _current is None or (wanted and wanted.lower() not in ("auto", _current.backend.name)):
        _current = select_backend()
    return _current.backend


def reset_backend_cache() -> None:
    """Forget the process-wide selection (tests, or after changing HWSYNC_BACKEND)."""
    global _current
    _current = None
