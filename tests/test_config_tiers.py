"""KV tier options: bad values are refused with a message naming the field; the CLI passes the flags
through to EngineConfig (and refuses an unknown policy)."""

from __future__ import annotations

import pytest

from radixrelay.cli import _engine_config, _parser
from radixrelay.config import EngineConfig


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
