"""Start-up checks before any runtime process starts (``radixrelay.runtime.preflight``): a tensor-parallel
size that does not split the model is refused with the sizes that would, read from the model's files
without torch; the Engine refuses it before it spawns anything."""

from __future__ import annotations

import json
import time

import pytest

from radixrelay import Engine
from radixrelay.config import EngineConfig
from radixrelay.model.model_config import ModelConfig
from radixrelay.runtime.preflight import check_startup


def _model(heads: int, kv_heads: int, mlp: int) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=1000, hidden_size=heads * 16, intermediate_size=mlp,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=16)


@pytest.mark.parametrize("model, good, bad", [
    (_model(32, 8, 14336), [1, 2, 4, 8, 16, 32], [3, 5, 6, 64]),     # Llama-3-8B: KV heads replicated past 8
    (_model(9, 3, 1536), [1, 3], [2, 4, 9]),                          # SmolLM2-135M: the MLP width stops 9
    (_model(12, 4, 1000), [1, 2, 4], [3, 6, 8]),                       # 3 and 6 split the heads, not the MLP
])
def test_what_a_tensor_parallel_size_must_split(model, good, bad):
    for tp in good:
        assert model.tensor_parallel_problem(tp) is None, tp
    for tp in bad:
        assert model.tensor_parallel_problem(tp).startswith(f"tensor parallel size {tp} does not split"), tp
    assert model.tensor_parallel_sizes(max(good)) == good


def test_the_default_model_at_tp_2_is_refused_with_the_sizes_that_split_it():
    check_startup(EngineConfig(tp=3))
    with pytest.raises(ValueError, match=r"tp=2 \(--tp\): .*9 query heads and 3 KV heads .*model 'default'; "
                                         r"the sizes that split it: 1, 3$"):
        check_startup(EngineConfig(tp=2))


def test_a_dummy_model_directory_is_read_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 192, "intermediate_size": 1000,
        "num_hidden_layers": 1, "num_attention_heads": 12, "num_key_value_heads": 4}))
    check_startup(EngineConfig(model=str(tmp_path), load_format="dummy", tp=4))
    with pytest.raises(ValueError, match=r"4 KV heads \(neither divides the other\) and an MLP width of 1000 .*"
                                         r"sizes that split it: 1, 2, 4$"):
        check_startup(EngineConfig(model=str(tmp_path), load_format="dummy", tp=3))


def test_the_engine_refuses_before_starting_processes(monkeypatch):
    start = time.monotonic()
    with pytest.raises(ValueError, match="does not split"):
        Engine(tp=2, kv_cache_tokens=2048)
    monkeypatch.setenv("RADIXRELAY_STEP_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="RADIXRELAY_STEP_TIMEOUT_S"):
        Engine(kv_cache_tokens=2048)
    assert time.monotonic() - start < 20                  # no model loaded, no child process started


def test_a_disk_tier_larger_than_its_filesystem_is_refused_and_the_default_fits(tmp_path):
    """A given ``disk_kv_gib`` must fit the free space of the directory's filesystem plus the files already
    there; the default (None) is 64 GiB or 90% of that space, whichever is less."""
    from radixrelay.radix.disk_store import DISK_SHARE, available_bytes, disk_tier_gib

    kv = tmp_path / "kv"
    free, kept = available_bytes(str(kv))                  # not made yet: its parent's filesystem
    assert kept == 0 and free > 0
    too_large = (free + (1 << 40)) / (1 << 30)
    with pytest.raises(ValueError, match=r"\(--disk-kv-gib\) does not fit .* GiB free .* give --disk-kv-gib"):
        check_startup(EngineConfig(disk_kv_path=str(kv), disk_kv_gib=too_large, host_kv_gib=1.0))
    check_startup(EngineConfig(disk_kv_path=str(kv), disk_kv_gib=0.001, host_kv_gib=1.0))
    check_startup(EngineConfig(disk_kv_path=str(kv), host_kv_gib=1.0))        # the default: never refused
    default = disk_tier_gib(str(kv), None)                 # free space moves a little meanwhile
    assert default <= 64.0 and abs(default - min(64.0, DISK_SHARE * free / (1 << 30))) < 0.5
    assert disk_tier_gib(str(kv), 3.0) == 3.0
    kv.mkdir()
    (kv / "page.kv").write_bytes(b"x" * 4096)              # files already there count as available
    assert available_bytes(str(kv))[1] == 4096
