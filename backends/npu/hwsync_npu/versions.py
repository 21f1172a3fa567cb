"""CANN and Ascend HDK (driver) versions: where a machine exposes them, how to order them, and
whether NPU IPC may be used. Pure functions over strings plus small file readers; no torch.

Formats seen on real machines (quoted in tests/test_npu_decisions.py with their sources):
- CANN: "8.3.RC1", "8.5.0", "9.0.0", "8.3.RC1.alpha003", internal builds "8.0.T63"
  (torch_npu's GetCANNInfo.h lists "a.b.c, a.b.RCd, a.b.Tg, a.b.RCd.alphaf");
  files: <toolkit>/<arch>-linux/ascend_toolkit_install.info has a line `version=8.3.RC1`.
- driver: /usr/local/Ascend/driver/version.info has `Version=25.3.rc1` and
  `package_version=25.3.rc1`; patch releases look like "25.0.rc1.1", "24.1.rc2.2", "25.5.2";
  internal builds carry a build tag: "25.5.t3.b001".
A string none of these fit is not guessed at; where its major.minor alone is above or below the
minimum, that decides, and otherwise hwsync says it cannot tell and uses shared memory.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass

#: NPU IPC (torch_npu's storage sharing) needs both, per the torch_npu IPC guide's
#: constraint: "仅支持在Ascend HDK 25.3.RC1及以上且CANN 8.3.RC1及以上版本使用".
MIN_IPC_DRIVER = "25.3.RC1"
MIN_IPC_CANN = "8.3.RC1"

DRIVER_VERSION_FILE = "/usr/local/Ascend/driver/version.info"
#: where CANN's set_env.sh points, then the default install roots (old layout, then 8.5+ layout)
CANN_HOME_ENVS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
CANN_DEFAULT_ROOTS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")

# Within one major.minor: internal T builds, then release candidates, then the final release.
_KIND_T, _KIND_RC, _KIND_FINAL = 0, 1, 2
# Within one RC or release: alpha before beta before the plain one.
_PRE_ALPHA, _PRE_BETA, _PRE_NONE = 0, 1, 2


@dataclass(frozen=True, order=True)
class AscendVersion:
    """A CANN or driver version, ordered the way Ascend releases follow each other."""

    major: int
    minor: int
    kind: int
    number: int
    pre: int = _PRE_NONE
    pre_number: int = 0
    patch: int = 0
    build: int = 0  # an internal build tag (".b001"): later builds of one version come after earlier ones


_STAGE = re.compile(r"^(?:(?P<rc>rc)|(?P<t>t))?(?P<num>\d+)$", re.IGNORECASE)
_PRE = re.compile(r"^(?P<tag>alpha|beta)(?P<num>\d+)$", re.IGNORECASE)
_BUILD = re.compile(r"^b(?P<num>\d+)$", re.IGNORECASE)


def parse_version(text: str) -> AscendVersion | None:
    """Parse a CANN or driver version string; None when it is not one (never guesses)."""
    parts = text.strip().replace("-", ".").split(".")
    if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    stage = _STAGE.match(parts[2])
    if stage is None:
        return None
    kind = _KIND_RC if stage["rc"] else _KIND_T if stage["t"] else _KIND_FINAL
    major, minor, number = int(parts[0]), int(parts[1]), int(stage["num"])
    rest = parts[3:]
    build_tag = _BUILD.match(rest[-1]) if rest else None  # internal builds: 25.5.t3.b001
    build = int(build_tag["num"]) if build_tag else 0
    if build_tag:
        rest = rest[:-1]
    if not rest:
        return AscendVersion(major, minor, kind, number, build=build)
    if len(rest) == 1 and rest[0].isdigit():  # driver patch: 25.0.rc1.1, 24.1.rc2.2, 25.3.RC1.2
        return AscendVersion(major, minor, kind, number, patch=int(rest[0]), build=build)
    pre = _PRE.match(rest[0]) if len(rest) == 1 else None
    if pre is None:
        return None
    tag = _PRE_ALPHA if pre["tag"].lower() == "alpha" else _PRE_BETA
    return AscendVersion(major, minor, kind, number, tag, int(pre["num"]), build=build)


def major_minor(text: str) -> tuple[int, int] | None:
    """The leading major.minor of a version string, however the rest is written (None without one)."""
    found = re.match(r"^\s*(\d+)\.(\d+)(?:[.\-]|$)", text)
    return (int(found[1]), int(found[2])) if found else None


def read_key_values(text: str) -> dict[str, str]:
    """`key=value` lines (version.info, ascend_toolkit_install.info) as a dict; keys as written."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key:
            fields[key.strip()] = value.strip().strip('"')
    return fields


def driver_version_from_info(text: str) -> str | None:
    """The driver version in a version.info text: package_version, else Version."""
    fields = read_key_values(text)
    return fields.get("package_version") or fields.get("Version") or None


def cann_version_from_install_info(text: str) -> str | None:
    """The CANN version in an ascend_toolkit_install.info text (its `version=` line)."""
    return read_key_values(text).get("version") or None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def driver_version_from_files(path: str = DRIVER_VERSION_FILE) -> str | None:
    """The installed driver's version from its version.info, or None when it is not there."""
    text = _read(path)
    return driver_version_from_info(text) if text is not None else None


def cann_install_info_paths(environ: dict[str, str] | None = None, machine: str | None = None) -> list[str]:
    """Candidate ascend_toolkit_install.info files, the sourced toolkit's first."""
    env = os.environ if environ is None else environ
    arch = machine or platform.machine()
    roots = [env[k] for k in CANN_HOME_ENVS if env.get(k)] + list(CANN_DEFAULT_ROOTS)
    seen: list[str] = []
    for root in roots:
        path = os.path.join(root, f"{arch}-linux", "ascend_toolkit_install.info")
        if path not in seen:
            seen.append(path)
    return seen


def cann_version_from_files(environ: dict[str, str] | None = None) -> str | None:
    """The CANN toolkit version from the first install-info file found, or None."""
    for path in cann_install_info_paths(environ):
        text = _read(path)
        if text is not None and (version := cann_version_from_install_info(text)):
            return version
    return None


def _judge_by_major_minor(what: str, found: str, minimum: str) -> str | None:
    """For a version string hwsync cannot parse: None when its major.minor alone is above the minimum's."""
    ours, least = major_minor(found), major_minor(minimum)
    if ours is not None and least is not None and ours > least:
        return None  # newer whatever the rest says
    if ours is not None and least is not None and ours < least:
        return f"{what} is {found}"
    return (f"the {what} version {found!r} is not in a format hwsync knows (e.g. {minimum}), and its major.minor "
            "alone cannot tell whether it is new enough")


@dataclass(frozen=True)
class IpcDecision:
    """Whether NPU IPC may be used, and the reason either way (logged once on fallback)."""

    use_ipc: bool
    reason: str


def decide_ipc(cann: str | None, driver: str | None) -> IpcDecision:
    """NPU IPC only when both versions are known and at least CANN 8.3.RC1 / HDK 25.3.RC1."""
    needs = f"NPU IPC needs Ascend HDK >= {MIN_IPC_DRIVER} and CANN >= {MIN_IPC_CANN}"
    problems, notes = [], []
    for what, found, minimum in (("CANN", cann, MIN_IPC_CANN), ("driver (HDK)", driver, MIN_IPC_DRIVER)):
        if not found:
            problems.append(f"the {what} version could not be read")
            continue
        parsed = parse_version(found)
        if parsed is None:
            problem = _judge_by_major_minor(what, found, minimum)
            if problem:
                problems.append(problem)
            else:
                notes.append(f"the {what} version {found!r} is not in a format hwsync knows; its major.minor "
                             f"alone is above {minimum}'s")
        elif parsed < parse_version(minimum):  # type: ignore[operator]
            problems.append(f"{what} is {found}")
    if problems:
        return IpcDecision(False, f"{needs}; {', '.join(problems)}: using shared memory instead, and device tensors "
                                  "go packed (no mapped sources); upgrade the driver/CANN to share device memory "
                                  "directly")
    note = f" ({'; '.join(notes)})" if notes else ""
    return IpcDecision(True, f"CANN {cann} and driver {driver} support NPU IPC{note}; receivers also map the "
                             "trainer's own allocator segments (mapped sources)")
