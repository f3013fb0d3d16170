"""Start-up checks that need more than an ``EngineConfig``'s own fields, run before any runtime process
starts: by the CLI (before the server binds or logs anything) and by the launcher (``RuntimeProcesses``:
the Engine and the server's start-up). A mistake is then one ``ValueError`` naming its cause, instead of
a child process failing with a traceback, possibly after the server has said it is ready.

- Every ``RADIXRELAY_*`` variable parses (``radixrelay.env.check_all``); the worker reads some of
  them only when it starts serving steps.
- ``tp`` splits the model: its query heads, KV heads and MLP width, read from the model's files
  (``radixrelay.model.config_files``: no weights, no torch), with the sizes that would.
- A disk tier's given capacity (``disk_kv_gib``) fits the filesystem of its directory: its free space plus
  the files already in the directory (pages kept from an earlier run, reused or deleted by this one). The
  default capacity is chosen to fit (``disk_store.disk_tier_gib``).
"""

from __future__ import annotations

from radixrelay import env
from radixrelay.config import EngineConfig
from radixrelay.radix.disk_store import DISK_SHARE, available_bytes

SIZES_SHOWN = 6       # tensor-parallel sizes a refusal suggests


def check_startup(cfg: EngineConfig) -> None:
    """``ValueError`` naming the cause if ``cfg`` (with the environment) cannot start."""
    env.check_all()
    if cfg.tp > 1:
        check_tensor_parallel(cfg)
    if cfg.disk_kv_path is not None:
        check_disk_space(cfg.disk_kv_path, cfg.disk_kv_gib)


def check_disk_space(path: str, gib: float | None) -> None:
    """``ValueError`` when a given disk tier size (``gib``; None: the default, which fits by construction)
    does not fit the space available under ``path`` (``disk_store.available_bytes``)."""
    if gib is None:
        return
    free, kept = available_bytes(path)
    if gib * (1 << 30) <= free + kept:
        return
    suggest = int(DISK_SHARE * (free + kept) / (1 << 30) * 10) / 10
    raise ValueError(f"disk_kv_gib={gib:g} (--disk-kv-gib) does not fit {path}: its filesystem has "
                     f"{free / (1 << 30):.1f} GiB free and the directory holds {kept / (1 << 30):.1f} GiB of files; "
                     f"give --disk-kv-gib {suggest:g} or less, or free space")


def check_tensor_parallel(cfg: EngineConfig) -> None:
    from radixrelay.model.config_files import read_model_config

    model = read_model_config(cfg.model, cfg.load_format)
    problem = model.tensor_parallel_problem(cfg.tp)
    if problem is None:
        return
    sizes = ", ".join(map(str, model.tensor_parallel_sizes()[:SIZES_SHOWN]))
    raise ValueError(f"tp={cfg.tp} (--tp): {problem} of model {cfg.model!r}; the sizes that split it: {sizes}")
