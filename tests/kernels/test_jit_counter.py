"""jit_counter: counts from Triton's hooks (driven by hand here: the CPU compiles nothing), idempotent
install, hooks found at install keep being called, a failing hook never raises, interpreted launches
count nothing."""

import pytest
import torch

from radixrelay.kernels import jit_counter, merge_attention_states
from tests.kernels.helpers import DEVICE, int32

knobs = pytest.importorskip("triton.knobs", reason="triton < 3.4 has no hook knobs")


@pytest.fixture
def hooks():
    """Triton's hooks as found, put back after the test (they are process globals)."""
    saved = knobs.runtime.jit_post_compile_hook, knobs.compilation.listener
    jit_counter.uninstall()
    yield
    jit_counter.uninstall()
    knobs.runtime.jit_post_compile_hook, knobs.compilation.listener = saved


def fire_post_compile(name: str = "_kernel"):
    """What Triton calls after a variant is compiled or loaded (keyword arguments of triton 3.4+)."""
    return knobs.runtime.jit_post_compile_hook(key="k", repr=f"{name}[num_warps=4](...)", fn=None, compile={},
                                               is_manual_warmup=False, already_compiled=False)


class Times:
    total = 250_000      # microseconds


def fire_listener(cache_hit: bool):
    knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=Times(), cache_hit=cache_hit)


def test_counts_compilations_and_cache_loads(hooks):
    assert jit_counter.install()
    before = jit_counter.counts()
    fire_listener(cache_hit=False)
    fire_post_compile("_a")
    fire_listener(cache_hit=True)
    fire_post_compile("_b")
    new = jit_counter.counts() - before
    assert (new.variants, new.compilations, new.cache_loads) == (2, 1, 1)
    assert new.compile_s == pytest.approx(0.5)
    assert jit_counter.recent()[-2:] == ("_a[num_warps=4](...)", "_b[num_warps=4](...)")
    assert jit_counter.variants() == before.variants + 2
    assert jit_counter.compilations() == before.compilations + 1


def test_install_is_idempotent_and_keeps_other_hooks(hooks):
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("hook", kw["repr"])) or "theirs"
    knobs.compilation.listener = lambda **kw: seen.append(("listener", kw["cache_hit"]))
    assert jit_counter.install() and jit_counter.install()
    before = jit_counter.counts()
    fire_listener(cache_hit=False)
    assert fire_post_compile("_c") == "theirs"           # the wrapped hook's answer comes back
    assert seen == [("listener", False), ("hook", "_c[num_warps=4](...)")]
    assert (jit_counter.counts() - before).variants == 1   # counted once, not once per install
    jit_counter.uninstall()
    fire_post_compile("_d")
    assert seen[-1] == ("hook", "_d[num_warps=4](...)")  # theirs is back in place, ours gone
    assert (jit_counter.counts() - before).variants == 1


def test_without_listener_every_variant_is_a_compilation(hooks, monkeypatch):
    runtime = type("Runtime", (), {"jit_post_compile_hook": None})()
    monkeypatch.setattr(jit_counter, "_knobs", lambda: type("Knobs", (), {"runtime": runtime})())
    assert jit_counter.install()
    before = jit_counter.counts()
    runtime.jit_post_compile_hook(repr="_e[...]")
    new = jit_counter.counts() - before
    assert (new.variants, new.compilations, new.cache_loads) == (1, 1, 0)
    jit_counter.uninstall()
    assert runtime.jit_post_compile_hook is None


def test_a_failing_hook_never_raises(hooks):
    class Bad:
        def __str__(self):
            raise RuntimeError("unprintable")

    assert jit_counter.install()
    knobs.runtime.jit_post_compile_hook(repr=Bad())
    knobs.compilation.listener(times=object(), cache_hit=False)   # no .total: counted, 0 s


def test_interpreted_launches_count_nothing(hooks):
    if DEVICE == "cuda":
        pytest.skip("on a GPU launches compile")
    assert jit_counter.install()
    before = jit_counter.counts()
    o_parts = torch.zeros((2, 4, 16), device=DEVICE)
    merge_attention_states(o_parts, torch.zeros((2, 4), device=DEVICE), int32([0, 2]), int32([0, 1]))
    assert jit_counter.counts() == before
