"""Every torch_npu name the NPU backend uses exists in the real torch-npu wheels users run.

Read statically: a wheel is a zip; its .py files are parsed with ast and its shared libraries
searched for binding names. Nothing from it is imported (it cannot be, without CANN). The names
come from hwsync_npu.api, the one list the backend itself uses, so the two cannot drift. Each test
runs on every checked version (api.CHECKED_TORCH_NPU_VERSIONS): 2.13.0, and 2.10.0.post4 in its
aarch64 build, the one vllm-ascend 0.26.0rc1 pins and Atlas 800T A2 (Kunpeng) hosts install. A name
a version lacks must be an optional one, whose fallback api.py names. The wheels are fetched by
ci/fetch-torch-npu.sh into .cache/torch-npu/; without one (and no way to download it) its tests skip
with that reason.
"""

from __future__ import annotations

import ast
import zipfile
from functools import lru_cache

import pytest
from npu_wheel import STATIC_PLATFORM, VERSIONS, missing, static_wheel_path

from hwsync_npu import api
from hwsync_npu.ipc import SHARE_FIELDS


@pytest.fixture(scope="module", params=VERSIONS)
def wheel(request: pytest.FixtureRequest) -> zipfile.ZipFile:
    path = static_wheel_path(request.param)
    if path is None:
        pytest.skip(missing(request.param, STATIC_PLATFORM.get(request.param)))
    with zipfile.ZipFile(path) as zf:
        zf.checked_version = request.param  # type: ignore[attr-defined]
        yield zf


def _libraries(zf: zipfile.ZipFile) -> list[str]:
    return [n for n in zf.namelist() if n.startswith("torch_npu/") and ".so" in n.rsplit("/", 1)[-1]]


@lru_cache(maxsize=8)
def _library_bytes(zf: zipfile.ZipFile, lib: str) -> bytes:
    return zf.read(lib)


def _in_libraries(zf: zipfile.ZipFile, needle: bytes) -> bool:
    return any(needle in _library_bytes(zf, lib) for lib in _libraries(zf))


@lru_cache(maxsize=None)
def _parse(zf: zipfile.ZipFile, path: str) -> ast.Module | None:
    try:
        return ast.parse(zf.read(path).decode("utf-8"), filename=path)
    except KeyError:
        return None


def module_file(zf: zipfile.ZipFile, module: str) -> str | None:
    """The wheel path defining `module` (package __init__ or module file)."""
    base = module.replace(".", "/")
    for candidate in (f"{base}/__init__.py", f"{base}.py"):
        if candidate in zf.namelist():
            return candidate
    return None


def _top_level(body: list[ast.stmt]):
    """Top-level statements, looking inside if/try blocks (conditional definitions count)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody
                                  + [s for h in node.handlers for s in h.body])


def _resolve_relative(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def defines(zf: zipfile.ZipFile, module: str, name: str, depth: int = 0) -> bool:
    """Whether `module` in the wheel binds `name` at top level (def, class, assignment, import)."""
    path = module_file(zf, module)
    tree = _parse(zf, path) if path else None
    if tree is None or depth > 5:
        return False
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return True
                if alias.name == "*" and isinstance(node, ast.ImportFrom):
                    source = _resolve_relative(module, path.endswith("__init__.py"), node)
                    if defines(zf, source, name, depth + 1):
                        return True
    return False


def resolve(zf: zipfile.ZipFile, dotted: str) -> bool:
    """Whether `dotted` (torch_npu.x.y.name) names something the wheel's sources define."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module, attrs = ".".join(parts[:split]), parts[split:]
        if module_file(zf, module) and len(attrs) == 1:
            return defines(zf, module, attrs[0])
    return False


def test_wheel_is_the_checked_version(wheel: zipfile.ZipFile) -> None:
    # torch_npu/version.py in the wheel: __version__ = '2.13.0'
    tree = _parse(wheel, "torch_npu/version.py")
    values = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    assert values["__version__"] == wheel.checked_version  # type: ignore[attr-defined]


@pytest.mark.parametrize("dotted", api.PYTHON_ATTRIBUTES)
def test_python_attribute_exists(wheel: zipfile.ZipFile, dotted: str) -> None:
    assert resolve(wheel, dotted), f"{dotted} is not defined in torch-npu {wheel.checked_version}"  # type: ignore[attr-defined]


@pytest.mark.parametrize("dotted", sorted(api.OPTIONAL_PYTHON_ATTRIBUTES))
def test_an_optional_attribute_is_there_or_has_a_fallback(wheel: zipfile.ZipFile, dotted: str) -> None:
    if not resolve(wheel, dotted):
        # the backend must not need it there: the fallback api.py names is what runs
        assert api.OPTIONAL_PYTHON_ATTRIBUTES[dotted]


def test_the_pinned_torch_npu_has_no_npurt_and_the_newest_has(wheel: zipfile.ZipFile) -> None:
    # what decides the host-registration route (host_register.py): npurt where it is, AscendCL elsewhere
    has = resolve(wheel, "torch_npu.npu.npurt") and _in_libraries(wheel, b"npuHostRegister")
    assert has == (wheel.checked_version == "2.13.0")  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", api.STORAGE_METHODS)
def test_storage_method_is_attached_to_untyped_storage(wheel: zipfile.ZipFile, method: str) -> None:
    # torch_npu/utils/storage.py: setattr(torch.UntypedStorage, "_share_npu_", _share_npu_)
    tree = _parse(wheel, "torch_npu/utils/storage.py")
    attached = {
        call.args[1].value for call in ast.walk(tree)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "setattr"
        and len(call.args) == 3 and ast.unparse(call.args[0]) == "torch.UntypedStorage"
        and isinstance(call.args[1], ast.Constant)
    }
    assert method in attached


@pytest.mark.parametrize("name", api.C_EXTENSION_NAMES)
def test_binding_name_is_in_the_extension(wheel: zipfile.ZipFile, name: str) -> None:
    assert _libraries(wheel), "the wheel holds no shared library"
    assert _in_libraries(wheel, name.encode()), f"{name} is in none of {_libraries(wheel)}"


def test_share_tuple_has_the_fields_the_ipc_transport_reads(wheel: zipfile.ZipFile) -> None:
    # torch_npu/multiprocessing/reductions.py unpacks `storage._share_npu_()` into 8 names and
    # rebuilds with `storage_cls._new_shared_npu(<8 args>)`; hwsync's records follow that order.
    tree = _parse(wheel, "torch_npu/multiprocessing/reductions.py")
    unpacks = [n.targets[0] for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and isinstance(n.value, ast.Call) and ast.unparse(n.value.func).endswith("._share_npu_")]
    assert unpacks and len(unpacks[0].elts) == len(SHARE_FIELDS)
    assert [e.id for e in unpacks[0].elts][:2] == ["device", "handle"]
    rebuilds = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("._new_shared_npu")]
    assert rebuilds and len(rebuilds[0].args) == len(SHARE_FIELDS)


def test_the_storage_checks_the_stand_in_applies_are_in_the_extension(wheel: zipfile.ZipFile) -> None:
    # tests/npu_torch_standin.py refuses what StorageSharing.cpp refuses, with its words
    for words in (b"Try to share a storage without base format", b"tuple of 8 items expected",
                  b"Supported to send NPU tensor received from another process"):
        assert _in_libraries(wheel, words), words


def test_torch_npus_own_hccl_groups_can_take_the_processs_world(wheel: zipfile.ZipFile) -> None:
    # why hwsync makes its HCCL communicators itself (hccl.py): ProcessGroupHCCL's ranktable and sub-communicator
    # paths, which derive a group from the process's own world, are in this build
    for words in api.RANKTABLE_PATHS:
        assert _in_libraries(wheel, words.encode()), words


def test_cann_version_query_takes_cann_and_driver(wheel: zipfile.ZipFile) -> None:
    # torch_npu/npu/utils.py: get_cann_version(module="CANN"), modules listed in its docstring
    tree = _parse(wheel, "torch_npu/npu/utils.py")
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_cann_version")
    doc = ast.get_docstring(func) or ""
    assert '"CANN"' in doc.replace("\\", "") and '"DRIVER"' in doc.replace("\\", "")
