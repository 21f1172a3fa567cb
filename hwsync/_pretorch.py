"""Hooks backends run before torch is imported (no torch, no vendor names here).

Some vendor plugins break `import torch` itself on machines without their runtime (a torch
device plugin that autoloads and fails). A backend may register a function in the entry-point
group `hwsync.pre_torch_import` that adjusts the environment first and returns a note saying
what it did (or None).
"""

from __future__ import annotations

from importlib.metadata import entry_points

#: what the hooks said, for `hwsync info`
PRE_TORCH_NOTES: list[str] = []


def run_pre_torch_hooks() -> list[str]:
    """Run every registered hook once; a broken hook is reported, never fatal."""
    if PRE_TORCH_NOTES:
        return PRE_TORCH_NOTES
    for ep in entry_points(group="hwsync.pre_torch_import"):
        try:
            note = ep.load()()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not stop hwsync from importing
            note = f"pre-torch hook {ep.name} failed: {type(exc).__name__}: {exc}"
        if note:
            PRE_TORCH_NOTES.append(str(note))
    return PRE_TORCH_NOTES
