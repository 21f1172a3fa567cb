"""verl workers inside bed hosts for test_verl_bed.py: hwsync's verl checkpoint engine, called as verl calls it.

No Ray (its raylets cannot span the bed's namespaces here): the test plays verl's
CheckpointEngineManager.update_weights through files in a shared folder, with its barriers, and each
worker makes the calls verl's worker classes make on its engine:
- built by verl's registry after `import_external_libs(custom_backend_module)`, with `is_master` on
  trainer ranks only (verl's ActorRolloutRefWorker) and without it on rollout workers (CheckpointEngineWorker);
- per step: `prepare()` -> metadata file; the test runs `build_topology` -> `init_process_group(**kwargs)`;
  then trainers `await send_weights(per_tensor_generator, global_steps=)` while rollouts' adapters read
  `receive_weights(global_steps=)`, copying each tensor before advancing; then `finalize()`.

The trainer ranks yield the full tensors themselves (the FSDP gather is test_verl_engine.py's subject).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import zlib
from typing import Any

#: (name, shape) of the test model: a 12 MB embedding chunked over the 2 MiB buckets, between small tensors
SHAPES = [("model.layers.0.input_layernorm.weight", (512,)), ("model.embed_tokens.weight", (6000, 1000)),
          ("model.layers.0.mlp.up_proj.weight", (1024, 512)), ("model.norm.weight", (512,))]


def weight(name: str, shape: tuple[int, ...], step: int) -> Any:
    """Tensor `name` at `step`: random bf16 bits, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{step}".encode()))
    return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)


def _path(folder: str, name: str) -> str:
    return os.path.join(folder, name)


def _write(folder: str, name: str, value: Any) -> None:
    tmp = _path(folder, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, _path(folder, name))


def _read(folder: str, name: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while not os.path.exists(_path(folder, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never wrote {name}")
        time.sleep(0.02)
    with open(_path(folder, name)) as f:
        return json.load(f)


def _engine(config: dict, is_master: bool | None) -> Any:
    """The engine as verl's workers build it (verl/workers/engine_workers.py, verl/checkpoint_engine/base.py)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(config["custom_backend_module"])
    kwargs = dict(bucket_size=config["update_weights_bucket_megabytes"] << 20,
                  **config["engine_kwargs"].get(config["backend"], {}))
    if is_master is not None:
        kwargs["is_master"] = is_master
    return CheckpointEngineRegistry.new(config["backend"], **kwargs)


def _log_lines() -> list[str]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if "built its group" in msg or "joined sender" in msg:
                lines.append(msg)

    logger = logging.getLogger("hwsync")
    logger.addHandler(Keep(logging.INFO))
    logger.setLevel(logging.INFO)
    return lines


def worker(folder: str, who: str, role: str, rank: int, config: dict, steps: list[int]) -> dict:
    """One trainer rank or rollout worker through verl's update_weights of every step; what it saw."""
    import torch

    torch.set_num_threads(1)
    lines = _log_lines()
    engine = _engine(config, rank == 0 if role == "trainer" else None)
    out: dict[str, Any] = {"steps": {}, "log": lines}
    _write(folder, f"up-{who}", os.getpid())
    try:
        for step in steps:
            _write(folder, f"meta-{who}-{step}", engine.prepare())  # 1. prepare on every worker
            engine.init_process_group(**_read(folder, f"topo-{who}-{step}"))  # 3. the topology verl's driver built
            _write(folder, f"inited-{who}-{step}", True)
            _read(folder, f"update-{step}")  # the manager's barrier: every worker joined
            if role == "trainer":
                gen = ((name, weight(name, shape, step)) for name, shape in SHAPES)  # get_per_tensor_param()
                result = asyncio.run(engine.send_weights(gen, global_steps=step))
            else:
                result = asyncio.run(_adapter(engine, step))
            _write(folder, f"updated-{who}-{step}", result)
            _read(folder, f"finalize-{step}")
            engine.finalize()  # 6. finalize on every worker
            out["steps"][step] = {"result": result, "epoch": engine.group_epoch}
            _write(folder, f"final-{who}-{step}", True)
    finally:
        engine.close()
    return out


async def _adapter(engine: Any, step: int) -> dict:
    """What verl's server adapter does with receive_weights(): copy each tensor before asking for the next."""
    import torch

    got: dict[str, torch.Tensor] = {}
    async for name, tensor in engine.receive_weights(global_steps=step):
        got[name] = tensor.clone()
    wrong = sorted(set(n for n, _ in SHAPES) ^ set(got))
    wrong += [n for n, s in SHAPES if n in got and not torch.equal(got[n].view(torch.int16),
                                                                   weight(n, s, step).view(torch.int16))]
    return {"tensors": len(got), "wrong": wrong}
