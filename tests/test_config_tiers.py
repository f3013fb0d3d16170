"""KV tier options: bad values are refused with a message naming the field; the CLI passes the flags
through to EngineConfig (and refuses an unknown policy)."""

from __future__ import annotations

import pytest

from radixrelay.cli import _engine_config, _parser
from radixrelay.config import EngineConfig
from tests.runtime.server_process import TINY_ENGINE


@pytest.mark.parametrize("kwargs, field", [
    (dict(host_kv_gib=-1.0), "host_kv_gib"),
    (dict(disk_kv_gib=-2.0), "disk_kv_gib"),
    (dict(disk_kv_path=""), "disk_kv_path"),
    (dict(disk_kv_path="/tmp/x", host_kv_gib=0.0), "disk_kv_path"),
    (dict(kv_tier_policy="mru"), "kv_tier_policy"),
])
def test_bad_tier_options_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**kwargs)


def test_cli_flags_reach_the_engine_config(tmp_path):
    args = _parser().parse_args(["serve", "--host-kv-gib", "3.5", "--disk-kv-path", str(tmp_path),
                                 "--disk-kv-gib", "7", "--kv-tier-policy", "lru"])
    cfg = _engine_config(args)
    assert (cfg.host_kv_gib, cfg.disk_kv_path, cfg.disk_kv_gib, cfg.kv_tier_policy) == (3.5, str(tmp_path), 7.0, "lru")
    assert _engine_config(_parser().parse_args(["serve"])).host_kv_gib is None      # auto by device
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--kv-tier-policy", "mru"])


def test_tiers_need_the_radix_cache(tmp_path):
    for kwargs in (dict(disk_kv_path=str(tmp_path)), dict(host_kv_gib=1.0)):
        with pytest.raises(ValueError, match="EngineConfig.disable_radix_cache: the KV tiers keep pages"):
            EngineConfig(disable_radix_cache=True, **kwargs)
    EngineConfig(disable_radix_cache=True, host_kv_gib=0.0)


def test_a_disk_tier_alone_on_the_cpu_gets_host_memory_to_stage_through(tmp_path, tiny_model_dir):
    """``--disk-kv-path`` without ``--host-kv-gib`` on the CPU, where host memory defaults to none, once gave no
    disk tier and no word of it: it now gets ``CPU_DISK_STAGING_GIB`` of host memory (split across ranks).
    The Engine runs the tiny dummy model (``tests/runtime/server_process.py``): only its tiers are looked at."""
    import torch

    from radixrelay import Engine
    from radixrelay.worker.kv_tiers import CPU_DISK_STAGING_GIB, host_tier_bytes

    cpu = torch.device("cpu")
    disk = str(tmp_path / "kv")
    assert host_tier_bytes(EngineConfig(), cpu) == 0
    assert host_tier_bytes(EngineConfig(disk_kv_path=disk), cpu) == int(CPU_DISK_STAGING_GIB * (1 << 30))
    assert host_tier_bytes(EngineConfig(disk_kv_path=disk, tp=2), cpu) == int(CPU_DISK_STAGING_GIB * (1 << 30)) // 2
    assert host_tier_bytes(EngineConfig(disk_kv_path=disk, host_kv_gib=0.25), cpu) == 1 << 28
    with Engine(model=str(tiny_model_dir), **TINY_ENGINE, kv_cache_tokens=2048, disk_kv_path=disk) as engine:
        stats = engine.stats()
        assert stats["tier_host_pages"] > 0 and stats["tier_disk_pages"] > 0, stats
