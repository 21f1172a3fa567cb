"""`hwsync info`: which backend is selected and why, what is installed, devices and transports."""

from __future__ import annotations

import json
from typing import Any

from hwsync._pretorch import PRE_TORCH_NOTES
from hwsync.backend.registry import backend_statuses, select_backend
from hwsync.errors import BackendError


def collect_info() -> dict[str, Any]:
    """The report as a dict; raises BackendError when no backend can be selected."""
    selection = select_backend(quiet=True)  # a fallback's reasons are the report's first line, not a warning
    backend = selection.backend
    device = backend.device()
    devices = []
    for index in range(device.count()):
        free, total = device.mem_get_info(index)
        devices.append({"index": index, "id": device.physical_id(index), "free_bytes": free, "total_bytes": total})
    transports = {}
    for name, transport in backend.transports().items():
        result = transport.available()
        into = transport.into_geometry
        transports[name] = {"usable": result.usable, "reason": result.reason,
                            "default_bucket_bytes": transport.default_bucket_bytes,
                            "into_geometry": None if into is None else {"bucket_bytes": into[0], "buffers": into[1]}}
    return {
        "delta_codec": delta_codec(),
        "selected": backend.name,
        "reason": selection.reason,
        "backends": [vars(s) for s in selection.statuses],
        "device": {"type": device.torch_type, "visible_devices_env": device.visible_devices_env, "devices": devices},
        "transports": transports,
        "pre_torch_notes": list(PRE_TORCH_NOTES),
    }


def delta_codec() -> dict[str, Any]:
    """What runs a delta's diff and apply on the host: numba's compiled kernels (whether they are compiled already,
    in numba's disk cache) or torch ops."""
    from hwsync.delta import native

    cached = native.cached_on_disk()
    if native.kernel() is None:
        return {"engine": "torch", "compiled": None, "note": "numba is not installed (pip install numba, or the delta "
                "extra): the codec runs torch ops, the same bytes, more slowly"}
    if cached is None:
        return {"engine": "numba", "compiled": None, "note": "numba's cache could not be read"}
    compiled, folder = cached
    note = f"compiled, in numba's disk cache ({folder}): each process loads them on a thread of its own, a few " \
        "seconds" if compiled else f"not compiled yet (numba's cache: {folder}): the first process in delta mode " \
        "compiles them on a thread of its own (about half a minute on a 2-core VM)"
    return {"engine": "numba", "compiled": compiled, "note": note + "; until loaded, deltas run torch ops (the same "
            "bytes): no sync waits for them"}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def render(info: dict[str, Any]) -> str:
    """Human-readable report."""
    lines = [f"selected backend: {info['selected']}  ({info['reason']})", "", "installed backends:"]
    for b in info["backends"]:
        state = "usable" if b["usable"] else "not usable"
        lines.append(f"  {b['name']:8s} {state:11s} {b['reason']}  [{b['distribution']}]")
    lines += ["", f"devices ({info['device']['type']}):"]
    for d in info["device"]["devices"]:
        lines.append(f"  [{d['index']}] {d['id']}: {_gib(d['free_bytes'])} free of {_gib(d['total_bytes'])}")
    lines += ["", "transports:"]
    for name, t in info["transports"].items():
        state = "usable" if t["usable"] else "not usable"
        into = t["into_geometry"]
        extra = f"; {into['bucket_bytes'] >> 20} MiB x {into['buffers']} for into= receivers" if into else ""
        lines.append(f"  {name:10s} {state:11s} {t['reason']}  (default bucket {t['default_bucket_bytes'] >> 20} MiB"
                     f"{extra})")
    codec = info.get("delta_codec")
    if codec:
        lines += ["", f"delta codec: {codec['engine']}: {codec['note']}"]
    if info.get("pre_torch_notes"):
        lines += ["", "set before torch was imported:"] + [f"  {note}" for note in info["pre_torch_notes"]]
    return "\n".join(lines)


def run_info(as_json: bool) -> int:
    """Print the report; exit status 1 with the reason when no backend is usable."""
    try:
        info = collect_info()
    except BackendError as exc:
        if as_json:
            print(json.dumps({"selected": None, "error": str(exc),
                              "backends": [vars(s) for s in backend_statuses()]}, indent=2))
        else:
            print(f"hwsync: {exc}")
        return 1
    print(json.dumps(info, indent=2) if as_json else render(info))
    return 0
