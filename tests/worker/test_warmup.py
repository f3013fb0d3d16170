"""Kernel warm-up: the variant list, the time budget, and (on the CPU, in the interpreter) that serving
steps through the TritonBackend launch no variant the warm-up did not: each launch's JIT cache key (its
argument specialisation, constexprs and launch options, as Triton computes them on a GPU) is recorded."""

import pytest
import torch

from radixrelay.attention.backend import TorchBackend
from radixrelay.attention.kv_cache import KVCache
from radixrelay.attention.metadata import BatchRequest, SharedRun, build_forward_batch, build_shared_runs
from radixrelay.kernels import extend, merge, shared_node
from radixrelay.worker.warmup import AttentionDims, serving_variants, warm_up_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLAMA_8B = AttentionDims(32, 8, 128)
TINY = AttentionDims(4, 2, 16)
PAGE = 4


def tiny_cache(num_pages: int = 640, dims: AttentionDims = TINY, dtype=torch.float16) -> KVCache:
    return KVCache(num_layers=1, num_pages=num_pages, page_size=PAGE, num_kv_heads=dims.num_kv_heads,
                   head_dim=dims.head_dim, dtype=dtype, device=DEVICE)


def test_variants_of_llama_8b():
    kv = tiny_cache(1, LLAMA_8B, torch.bfloat16)
    names = [v.name for v in serving_variants(LLAMA_8B, kv)]
    assert len(set(names)) == len(names)
    tma = 1 if shared_node.tma_capable(kv.device) else 0
    assert sum(n.startswith("paged_decode") for n in names) == 4       # alone x 2 dtypes, beside, beside light
    assert sum(n.startswith("merge") for n in names) == 2 * 6           # indexed / splits x BLOCK_H 1..32
    assert sum(n.startswith("shared_node") for n in names) == 2 * (3 + tma)
    assert [n for n in names if n.startswith("extend")] == [f"extend BLOCK_M={m}" for m in (16, 32, 64, 128)]
    assert [n for n in names if n.startswith("host_copy")] == ["host_copy int64", "host_copy int32",
                                                               "host_copy float32", "host_copy uint8"]
    no_overlap = [v.name for v in serving_variants(LLAMA_8B, kv, overlap=False)]
    assert set(names) - set(no_overlap) == {"paged_decode beside out=float32", "paged_decode beside light out=float32"}


def test_value_sets_are_closed():
    """What the launchers pick from step data stays inside the sets the warm-up launches."""
    assert {extend.tile_rows(n) for n in range(1, 5000)} == set(extend.tile_rows_choices())
    for heads, dim in ((32, 128), (4, 16), (40, 256), (1, 64)):
        choices = merge.block_h_choices(heads, dim)
        assert {merge.pick_block_h(rows, heads, dim, torch.device("cpu")) for rows in range(1, 3000)} <= set(choices)
    for group in (1, 3, 4, 8, 32, 128):
        configs = {c for c, _ in shared_node.tile_configs(group, 128, torch.device("cpu"))}
        assert {shared_node.tile_config(rows * group) for rows in range(1, 600)} == configs


def test_budget_and_backends():
    kv = tiny_cache()
    names = [v.name for v in serving_variants(TINY, kv)]
    spent = warm_up_kernels(TINY, kv, time_budget_s=0.0)
    assert (spent.launches, spent.skipped, spent.complete) == (0, tuple(names), False)
    assert warm_up_kernels(TINY, kv, TorchBackend()).launches == 0
    with pytest.raises(ValueError, match="do not match the KV cache"):
        warm_up_kernels(AttentionDims(4, 2, 32), kv)


class KeyRecorder:
    """Wraps the kernels of radixrelay.kernels: records each launch's JIT cache key, then launches."""

    KERNELS = (("paged_decode", "_paged_decode_kernel"), ("shared_node", "_shared_node_kernel"),
               ("merge", "_merge_kernel"), ("extend", "_extend_kernel"))

    def __init__(self, monkeypatch) -> None:
        jit = pytest.importorskip("triton.runtime.jit")
        backends = pytest.importorskip("triton.backends")
        if not hasattr(jit, "create_function_from_signature"):
            pytest.skip("this triton binds kernel arguments differently")
        import importlib

        self.keys: list[tuple] = []
        for module_name, name in self.KERNELS:
            module = importlib.import_module(f"radixrelay.kernels.{module_name}")
            kernel = getattr(module, name)
            spec = jit.JITFunction(kernel.fn, **getattr(kernel, "kwargs", {}))
            binder = jit.create_function_from_signature(spec.signature, spec.params, backends.BaseBackend)
            monkeypatch.setattr(module, name, _Spy(kernel, binder, name, self.keys))


class _Spy:
    def __init__(self, kernel, binder, name, keys) -> None:
        self.kernel, self.binder, self.name, self.keys = kernel, binder, name, keys

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            self.keys.append((self.name, str(specialization), str(sorted(options.items()))))
            return self.kernel[grid](*args, **kwargs)
        return launch


def steps(kv: KVCache):
    """Serving-like batches that move every per-step value: batch sizes, page-table widths (1, 16, 17),
    extends before decodes (index slices at odd offsets), split counts, cascades of 1-2 nodes on
    consecutive or scattered pages, a prefill cascade, extend chunks of every tile size."""
    def req(seq: int, new: int = 1, base: int = 0):
        return BatchRequest(range(base, base + -(-seq // PAGE)), seq - new, new)

    def runs(*groups):
        return build_shared_runs([SharedRun(rows, pages, tokens) for rows, tokens, pages in groups], DEVICE)

    yield build_forward_batch([req(3)], PAGE, DEVICE, num_decodes=1)                             # width 1
    yield build_forward_batch([req(64), req(5), req(68)], PAGE, DEVICE, num_decodes=3)          # 16, 17
    yield build_forward_batch([req(200, base=3)] * 5, PAGE, DEVICE, num_decodes=5)             # splits
    yield build_forward_batch([req(2048, base=100)], PAGE, DEVICE, num_decodes=1)              # 16 splits
    yield build_forward_batch([req(30, 17), req(9), req(40)], PAGE, DEVICE, num_decodes=2)     # 1 extend
    yield build_forward_batch([req(20, 2), req(70, 33), req(9, 9), req(15), req(41)], PAGE, DEVICE,
                              num_decodes=2)
    yield build_forward_batch([req(100, 100)], PAGE, DEVICE)
    shared = runs(([0, 1, 2], 24, range(10, 16)), ([1], 8, [30, 2]))
    yield build_forward_batch([req(30), req(50), req(40)], PAGE, DEVICE, num_decodes=3, kv_start=[24, 32, 24],
                              decode_runs=shared)
    yield build_forward_batch([req(30, 6), req(30), req(50), req(40)], PAGE, DEVICE, num_decodes=3,
                              kv_start=[0, 24, 32, 24], decode_runs=shared)
    one = runs(([0, 1, 2, 3, 4, 5], 1100, range(20, 295)))
    yield build_forward_batch([req(1110)] * 6, PAGE, DEVICE, num_decodes=6, kv_start=[1100] * 6, decode_runs=one)
    prefill = runs((list(range(0, 5)) + list(range(5, 12)), 16, range(40, 44)))
    yield build_forward_batch([req(21, 5), req(30, 7), req(9)], PAGE, DEVICE, num_decodes=1, kv_start=[16, 16, 0],
                              prefill_runs=prefill)


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU interpreter version of gpu_jit_check.py")
def test_serving_launches_nothing_new_after_warm_up(monkeypatch):
    from radixrelay.attention.triton_backend import TritonBackend

    recorder = KeyRecorder(monkeypatch)
    kv = tiny_cache()
    report = warm_up_kernels(TINY, kv, TritonBackend(overlap=False))
    assert report.complete and report.launches == len(serving_variants(TINY, kv, overlap=False))
    warm = set(recorder.keys)
    attention = [v for v in serving_variants(TINY, kv, overlap=False) if not v.name.startswith("host_copy")]
    assert len(warm) == len(attention)                    # every variant launched is a distinct key
    recorder.keys.clear()
    backend = TritonBackend(overlap=False)
    for batch in steps(kv):
        q = torch.randn((batch.num_tokens, TINY.num_q_heads, TINY.head_dim), dtype=kv.dtype, device=DEVICE)
        o, _ = backend.forward_with_lse(q, 0, kv, batch)
        assert not torch.isnan(o).any()
    kernels = {key[0] for key in recorder.keys}
    assert kernels == {name for _, name in KeyRecorder.KERNELS}, "the steps reach every kernel"
    new = [key for key in recorder.keys if key not in warm]
    assert not new, f"{len(new)} launches outside the warm-up, first: {new[0]}"


def _tiny_runner() -> "ModelRunner":
    from radixrelay.model import ModelConfig, load_model
    from radixrelay.worker.model_runner import ModelRunner

    cfg = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    model, _ = load_model(cfg, dtype=torch.float64, seed=1)
    kv = KVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float64,
                 device="cpu")
    return ModelRunner(model, kv, TorchBackend(), seed=3)


def _sampled_tokens(runner) -> list[int]:
    """Two requests (one unseeded at temperature 1: it draws from the runner's shared generator), eight
    steps; the tokens they sample."""
    from radixrelay.protocol.step import AdmittedRequest, ExtendItem, PageAppend, StepPlan
    from radixrelay.sampling_params import SamplingParams

    hot = SamplingParams(max_tokens=50, temperature=1.0)
    cold = SamplingParams(max_tokens=50, temperature=0.0)
    out = runner.step(StepPlan(0, admitted=[AdmittedRequest(0, [5, 6, 7, 8, 9], 5, [0, 1], hot),
                                            AdmittedRequest(1, [9, 8, 7], 3, [2], cold)],
                               extends=[ExtendItem(0, 0, 5, True), ExtendItem(1, 0, 3, True)]))
    tokens = list(out.token_ids)
    for step in range(1, 8):
        appends = [PageAppend(1, [3])] if step == 1 else []
        out = runner.step(StepPlan(step, page_appends=appends, decodes=[0, 1]))
        tokens += out.token_ids
    return tokens


def test_start_up_warm_up_step_leaves_nothing_behind():
    from radixrelay.worker.warmup import warm_up_steps

    fresh, warmed = _tiny_runner(), _tiny_runner()
    seconds = warm_up_steps(warmed, prompt_tokens=40, decode_steps=4)   # clamped to the 8 pages' 32 slots
    assert seconds > 0
    assert warmed.num_resident == 0
    assert (warmed.counters.eager_steps, warmed.counters.graph_replays, warmed.counters.extend_row_steps) == (0, 0, 0)
    assert _sampled_tokens(warmed) == _sampled_tokens(fresh)
    assert ((warmed.counters.eager_steps, warmed.counters.graph_replays)
            == (fresh.counters.eager_steps, fresh.counters.graph_replays))
