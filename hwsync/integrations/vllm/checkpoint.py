"""The manifest an engine expects, read from the checkpoint it was started on, and the check.

An inference engine's `load_weights` accepts the names, shapes and dtypes of the checkpoint it
was loaded from (HF names such as `model.layers.0.self_attn.q_proj.weight`, full unsharded
shapes), whatever it fuses or shards them into afterwards. So the exact expectation is the
checkpoint's own safetensors headers: only the headers are read (a few KB), never the data.

Rules of the check (every violation names the tensor and the fix):
- a name the checkpoint lacks is refused (except a tied `lm_head.weight`, which engines skip);
- a shape other than the checkpoint's is refused;
- a dtype the wire does not know is refused; a floating dtype may differ from the checkpoint's
  within float32/bfloat16/float16 (load_weights casts), anything else must match exactly;
- unless `allow_partial`, every checkpoint tensor must be announced: engines that fuse
  tensors (q/k/v into qkv) rebuild the fused layer from the parts and would keep garbage in
  the parts left out.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterable

from hwsync.errors import ManifestError
from hwsync.sync.spec import WIRE_DTYPES, TensorSpec

#: safetensors header dtype codes, by hwsync's wire dtype names
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64",
}
#: floating dtypes load_weights converts between on copy
CASTABLE_FLOATS = frozenset({"float32", "bfloat16", "float16"})
#: what a tied output head is called in HF state dicts, and the tensor it shares
TIED_HEAD, TIED_EMBEDDING_SUFFIX = "lm_head.weight", "embed_tokens.weight"


def read_safetensors_header(path: str) -> list[TensorSpec]:
    """Names, dtypes and shapes stored in one .safetensors file (reads the header only)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    specs = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"].lower())
        specs.append(TensorSpec(name, dtype, tuple(int(d) for d in meta["shape"])))
    return specs


def safetensors_files(directory: str) -> list[str]:
    """The .safetensors files of a checkpoint directory, as its index lists them when it has one."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        # the index names the shards in use; a folder may also hold a consolidated copy
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, shard) for shard in shards]
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def resolve_checkpoint_dir(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A local directory for `model`: the path itself, or the HF cache snapshot the engine loaded."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download  # only for hub ids; vLLM depends on it

    return snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True,
                             allow_patterns=["*.safetensors", "*.safetensors.index.json"])


def checkpoint_manifest(model: str, revision: str | None = None, download_dir: str | None = None) -> list[TensorSpec]:
    """The tensors of the checkpoint an engine was started on; an error says how to make it readable."""
    directory = resolve_checkpoint_dir(model, revision, download_dir)
    files = safetensors_files(directory)
    if not files:
        raise ManifestError(
            f"checkpoint {model!r} has no .safetensors files, so hwsync cannot know which tensors the engine "
            "accepts; save the initial checkpoint with safetensors (save_pretrained does by default)"
        )
    specs: list[TensorSpec] = []
    for path in files:
        specs.extend(read_safetensors_header(path))
    return specs


def check_manifest(expected: Iterable[TensorSpec], announced: Iterable[TensorSpec], *,
                   allow_partial: bool = False, tied_embeddings: bool = False) -> None:
    """Raise ManifestError naming the first bad tensors of `announced` against `expected`."""
    by_name = {spec.name: spec for spec in expected}
    if tied_embeddings and TIED_HEAD not in by_name:
        embedding = next((s for n, s in by_name.items() if n.endswith(TIED_EMBEDDING_SUFFIX)), None)
        if embedding is not None:  # engines skip it: the head is the embedding
            by_name[TIED_HEAD] = TensorSpec(TIED_HEAD, embedding.dtype, embedding.shape)
    problems: list[str] = []
    seen: set[str] = set()
    for spec in announced:
        seen.add(spec.name)
        want = by_name.get(spec.name)
        if want is None:
            problems.append(f"tensor {spec.name!r} is not a weight of the engine's model; send the names of "
                            "the checkpoint the engine was started on (HF names, e.g. model.state_dict())")
        elif spec.dtype not in WIRE_DTYPES:
            problems.append(f"tensor {spec.name!r} has unknown dtype {spec.dtype!r}; send {want.dtype}")
        elif spec.shape != want.shape:
            problems.append(f"tensor {spec.name!r} has shape {list(spec.shape)} but the engine's model has "
                            f"{list(want.shape)}; send the full (unsharded) tensor of the checkpoint's shape")
        elif spec.dtype != want.dtype and not {spec.dtype, want.dtype} <= CASTABLE_FLOATS:
            problems.append(f"tensor {spec.name!r} has dtype {spec.dtype} but the engine's model has "
                            f"{want.dtype}; convert it with .to(torch.{want.dtype}) before sending")
    missing = [name for name in by_name if name not in seen and name != TIED_HEAD]
    if missing and not allow_partial:
        problems.append(f"{len(missing)} weights of the engine's model are not in the sync, e.g. "
                        f"{missing[:3]}; send every tensor (or allow_partial=True for whole-layer updates)")
    if problems:
        more = f" (and {len(problems) - 3} more problems)" if len(problems) > 3 else ""
        raise ManifestError("sync refused before any weight changed: " + "; ".join(problems[:3]) + more)
