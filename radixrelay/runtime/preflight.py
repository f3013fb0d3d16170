"""Start-up checks that need more than an ``EngineConfig``'s own fields, run before any runtime process
starts: by the CLI (before the server binds or logs anything) and by the launcher (``RuntimeProcesses``:
the Engine and the server's start-up). A mistake is then one ``ValueError`` naming its cause, instead of
a child process failing with a traceback, possibly after the server has said it is ready.

- Every ``RADIXRELAY_*`` variable parses (``radixrelay.env.check_all``); the worker reads some of
  them only when it starts serving steps.
- ``tp`` splits the model: its query heads, KV heads and MLP width, read from the model's files
  (``radixrelay.model.config_files``: no weights, no torch), with the sizes that would.
"""

from __future__ import annotations

from radixrelay import env
from radixrelay.config import EngineConfig

SIZES_SHOWN = 6       # tensor-parallel sizes a refusal suggests


def check_startup(cfg: EngineConfig) -> None:
    """``ValueError`` naming the cause if ``cfg`` (with the environment) cannot start."""
    env.check_all()
    if cfg.tp > 1:
        check_tensor_parallel(cfg)


def check_tensor_parallel(cfg: EngineConfig) -> None:
    from radixrelay.model.config_files import read_model_config

    model = read_model_config(cfg.model, cfg.load_format)
    problem = model.tensor_parallel_problem(cfg.tp)
    if problem is None:
        return
    sizes = ", ".join(map(str, model.tensor_parallel_sizes()[:SIZES_SHOWN]))
    raise ValueError(f"tp={cfg.tp} (--tp): {problem} of model {cfg.model!r}; the sizes that split it: {sizes}")
