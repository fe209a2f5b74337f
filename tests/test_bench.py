"""tools.bench's arithmetic on the CPU: the floor model (tools/floors.py), the union of device intervals
behind the GPU-busy fraction, the cache that holds every workload (D128 included) and the rendering of
a run's record; the speculative workloads (tools/bench_speculative.py): their flags, arithmetic, and the whole
driver on the tiny preset, eagerly. Timing itself needs a GPU (tools.bench refuses to run without one, test_cli.py)."""

import json

import pytest
import torch

from helpers import benchmark_script
from metrale_graph import PRESETS, HybridModel
from metrale_graph.tools import bench, bench_runs, floors, profiling, workloads
from metrale_graph.ops import gemv
from metrale_graph.speculative.drafting import MtpDrafter
from metrale_graph.weights import weight_shapes

MODELS = list(PRESETS)


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


@pytest.mark.parametrize("preset", MODELS)
def test_phases_partition_the_step(preset):
    """Every weight of every family belongs to one phase; the phases' FLOPs and bytes add up to the step's
    (so phase_floor_ms >= floor_ms), and the bytes are, derived independently here: the weights (the
    embedding's T looked-up rows, MoE experts scaled by the share a batch touches), K/V read and written,
    the GDN states (fp32) and conv states read and written, the logits written."""
    from metrale_graph.spec import SCALE, model_spec

    cfg = PRESETS[preset]
    shapes = weight_shapes(cfg)
    specs = model_spec(cfg)  # FP8 presets: converted weights one byte an element, their scales four
    size = {n: 1 if s.fp8 else 4 if s.kind == SCALE else 2 for n, s in specs.items()}
    for name in shapes:
        assert floors.phase_of(cfg, name)[0] in floors.KINDS
    for w in workloads.WORKLOADS.values():
        f = floors.step_floor(cfg, w.new, w.cached)
        assert sum(p.flops for p in f.phases) == pytest.approx(f.flops)
        assert sum(p.bytes for p in f.phases) == pytest.approx(f.bytes)
        assert f.phase_floor_ms >= f.floor_ms - 1e-9
        assert f.phase_floor_ms == pytest.approx(sum(f.by_kind().values()))
        T, B = sum(w.new), len(w.new)
        share = floors.expected_experts(cfg, T) / cfg.num_experts if cfg.moe_layers else 0
        weights = sum(_numel(s.shape) * size[n] * (share if ".experts." in n else 1) for n, s in specs.items()
                      if n != "embed_tokens.weight")
        if cfg.tie_word_embeddings:
            weights += 2 * _numel(shapes["embed_tokens.weight"])
        kv = 2 * cfg.num_key_value_heads * cfg.head_dim * (sum(w.cached) + T) * len(cfg.full_layers)
        gdn = 2 * B * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        conv = 2 * B * cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1)
        expected = weights + 2 * (T * cfg.hidden_size + kv + B * cfg.vocab_size) \
            + (gdn + 2 * conv) * len(cfg.linear_layers)
        assert f.bytes == pytest.approx(expected, rel=1e-9)


def test_embedding_lookup_reads_rows_not_the_table():
    """The embedding table was counted as read whole (2 GB for the 9B shape): a lookup reads the T rows of
    the new tokens. D1's floor is ~3.73 ms (it was 4.20), as issue 24 estimated it."""
    cfg = PRESETS["qwen3.5-9b"]
    d1 = floors.step_floor(cfg, (1,), (2048,))
    (embedding,) = [p for p in d1.phases if p.kind == floors.EMBEDDING]
    assert embedding.bytes == cfg.hidden_size * 2 and embedding.flops == 0
    assert d1.floor_ms == pytest.approx(3.73, abs=0.01)
    assert d1.phase_floor_ms == pytest.approx(d1.floor_ms, rel=1e-3)  # memory-bound throughout
    w2 = floors.step_floor(cfg, (512,) * 8, (0,) * 8)
    assert [p for p in w2.phases if p.kind == floors.EMBEDDING][0].bytes == 4096 * cfg.hidden_size * 2


def test_moe_floor_counts_active_flops_and_touched_experts():
    """One token runs (and reads) exactly top-k experts per layer; a large batch touches nearly all. For the
    35B-A3B shape the phase floors land near issue 25's estimates (W2 ~30.3 ms, W6 ~23.5 ms): above them by
    the GDN state's FLOPs (3 x 2 K V per token and value head), which they left out."""
    cfg = PRESETS["qwen3.5-35b-a3b"]
    assert floors.expected_experts(cfg, 1) == pytest.approx(cfg.num_experts_per_tok)
    assert floors.expected_experts(cfg, 4096) == pytest.approx(cfg.num_experts, rel=1e-3)
    for name, estimate in (("W2", 30.3), ("W6", 23.5)):
        w = workloads.WORKLOADS[name]
        f = floors.step_floor(cfg, w.new, w.cached)
        recurrence = sum(p.flops for p in f.phases if p.kind == floors.GDN_RECURRENCE) / floors.MATMUL_RATE * 1e3
        assert f.phase_floor_ms - recurrence == pytest.approx(estimate, rel=0.01), name
        assert f.phase_floor_ms > 1.15 * f.floor_ms  # the experts are memory-bound, the projections compute-bound


def test_floor_of_several_gpus_divides_the_work():
    cfg = PRESETS["qwen3.5-9b"]
    one, two = (floors.step_floor(cfg, (512,) * 8, (0,) * 8, gpus) for gpus in (1, 2))
    assert two.floor_ms == pytest.approx(one.floor_ms / 2) and two.phase_floor_ms == pytest.approx(one.phase_floor_ms / 2)
    assert sum(two.by_kind(2).values()) == pytest.approx(two.phase_floor_ms)


def test_a_weight_no_phase_reads_is_named():
    with pytest.raises(ValueError, match="which phase reads weight 'layers.0.mystery.weight'"):
        floors.phase_of(PRESETS["tiny"], "layers.0.mystery.weight")


def test_d128_decode_floor_is_states_and_kv():
    """D128 (128 streams of 1 token after 2048 cached): its floor is dominated by the GDN states (128 slots x
    ~50 MB, read and written) and the K/V reads, not the weights."""
    cfg = PRESETS["qwen3.5-9b"]
    assert workloads.WORKLOADS["D128"] == workloads.Workload((1,) * 128, (2048,) * 128)
    assert workloads.fitting_workloads(cfg, ["D128"]) == (["D128"], {})
    f = workloads.workload_floor(cfg, workloads.WORKLOADS["D128"])
    kinds = f.by_kind()
    state_mb = 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim \
        * len(cfg.linear_layers) / 2 / 1e6
    assert 49 < state_mb < 51
    assert kinds[floors.GDN_RECURRENCE] + kinds[floors.ATTENTION] > 0.5 * f.floor_ms
    assert 8.5 < f.floor_ms < 9.5  # issue 24: "the floor is ~9 ms"


@pytest.mark.parametrize("intervals, expected", [
    ([], 0.0),
    ([(0, 10)], 10.0),
    ([(0, 10), (20, 25)], 15.0),  # disjoint: the gap is idle
    ([(0, 10), (5, 15)], 15.0),  # overlapping kernels (two streams) count once
    ([(0, 10), (2, 3)], 10.0),  # nested
    ([(20, 25), (0, 10), (10, 12)], 17.0),  # unsorted, touching
    ([(5, 5), (7, 6)], 0.0),  # empty or reversed intervals add nothing
])
def test_union_of_device_intervals(intervals, expected):
    assert profiling.union_ms(intervals) == expected


def test_busy_fraction_of_each_marked_window():
    """Windows are marked by pairs of "spin" kernels (torch.cuda._sleep): each one's busy fraction is the union of
    the device intervals between its markers' inner ends over that span; what lies outside (between two windows,
    before the first) counts nowhere, a kernel across a marker only inside."""
    from types import SimpleNamespace

    def event(name, start, end, device="cuda"):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event("spin_kernel", 0, 10), event("gemm", 12, 20), event("gemm", 15, 25), event("spin_kernel", 30, 40),
              event("copy", 50, 60), event("spin_kernel", 100, 110), event("gemm", 105, 130),
              event("gemm", 140, 150, device="cpu"), event("spin_kernel", 160, 170)]
    # window 1: 10 .. 30, busy 12 .. 25; window 2: 110 .. 160, busy 110 .. 130 (the gemm from 105 clipped)
    assert profiling.busy_between_markers(events, "cuda") == [13 / 20, 20 / 50]
    with pytest.raises(ValueError, match="3 marker kernels"):
        profiling.busy_between_markers(events[:-1], "cuda")


def test_device_work_by_name_in_each_marked_window():
    """kernels_between_markers: per window, each name's device time clipped to the window and its launches, largest
    first; the markers and what lies outside every window are not counted."""
    from types import SimpleNamespace

    def event(name, start, end, device="cuda"):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event("spin_kernel", 0, 10), event("gemm", 12, 20), event("gemm", 15, 25), event("copy", 26, 27),
              event("spin_kernel", 30, 40), event("gemm", 50, 60), event("spin_kernel", 100, 110),
              event("gemm", 105, 130), event("norm", 131, 135), event("norm", 140, 150, device="cpu"),
              event("spin_kernel", 160, 170)]
    assert profiling.kernels_between_markers(events, "cuda") == [
        [("gemm", 18, 2), ("copy", 1, 1)], [("gemm", 20, 1), ("norm", 4, 1)]]
    assert profiling.kernels_between_markers(events, "cuda", top=1)[1] == [("gemm", 20, 1)]
    assert profiling.activities_between_markers(events, "cuda") == [3, 2]  # (the gemm at 50 lies between them)
    with pytest.raises(ValueError, match="3 marker kernels"):
        profiling.kernels_between_markers(events[:-1], "cuda")


def test_device_intervals_from_a_real_profile():
    """device_intervals reads torch.profiler's events (checked on the CPU's: there are no CUDA ones)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            x = x @ x / 16
    events = prof.events()
    cpu = profiling.device_intervals(events, DeviceType.CPU)
    assert cpu and all(end >= start for start, end in cpu)
    first, last = min(s for s, _ in cpu), max(e for _, e in cpu)
    assert 0 < profiling.union_ms(cpu) <= last - first
    assert profiling.device_intervals(events, DeviceType.CUDA) == []


def test_bench_cache_holds_d128_and_contexts_are_prefilled_in_bounded_calls(monkeypatch):
    """The cache holds the widest workload's streams at once (a slot each; D128: 128) and the largest's blocks;
    the untimed context prefill is split into calls of at most CONTEXT_TOKENS tokens (D128's 262144 cached
    tokens in one call would need four times D32's activation memory)."""
    model = HybridModel.from_preset("tiny")
    d128, w1 = workloads.Workload((1,) * 128, (3,) * 128), workloads.Workload((300,), (0,))
    cache = workloads.bench_cache(model, [d128, w1])
    assert cache.num_slots == 128 and cache.max_context >= 300
    calls = []
    real = model.prefill

    def prefill(c, streams):
        calls.append(sum(len(s.tokens) for s in streams))
        return real(c, streams)

    monkeypatch.setattr(model, "prefill", prefill)
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, 512, (3,), generator=gen) if i % 10 == 0 else None for i in range(128)]  # 13
    workloads.prefill_contexts(model, cache, contexts, max_tokens=10)
    assert calls == [9, 9, 9, 9, 3]
    assert list(cache.context_lens[:128]) == [3 if i % 10 == 0 else 0 for i in range(128)]
    assert workloads.grid_of(["D1", "D32", "D128"]) == ([1, 32, 128], [1, 32, 128])


def _record(results, variants, **extra):
    return {"tool": "bench", "preset": "qwen3.5-9b", "layers": 32, "tp": 1, "moe_parallel": None,
            "device": "NVIDIA H200", "repeat": 3, "generation": None, "results": results, **extra}


def test_render_reports_both_floors_and_the_busy_fraction():
    rows = [{"workload": "W2", "label": "8x512", "tokens": 4096, "floor_ms": 72.33, "phase_floor_ms": 72.79,
             "eager_ms": 150.0, "graphs_ms": 110.0, "gpu_busy": 0.947, "peer_ms": 220.0},
            {"workload": "D1", "label": "1x1 +2048 cached", "tokens": 1, "floor_ms": 3.73, "phase_floor_ms": 3.73,
             "eager_ms": 40.0, "graphs_ms": 5.9, "gpu_busy": None, "peer_ms": 30.0}]
    variants = ["peer", "eager", "graphs"]
    record = _record(rows, variants)
    text = bench_runs.render(record, variants)
    lines = text.splitlines()
    assert lines[0] == "qwen3.5-9b, bf16, NVIDIA H200"
    headers = lines[1].split("  ")
    for h in ("floor ms", "phase floor ms", "graphs / floor", "graphs / phase floor", "GPU busy", "peer / graphs"):
        assert h in lines[1], h
    assert len([h for h in headers if h.strip()]) == 12
    w2 = lines[3]
    assert f"{110 / 72.33:.2f}x" in w2 and f"{110 / 72.79:.2f}x" in w2 and "94.7%" in w2 and "2.00x" in w2
    assert lines[4].split()[-2:] == ["-", "169"]  # no busy fraction recorded; 1 token / 5.9 ms
    markdown = bench_runs.render(record, variants, "markdown")
    assert markdown.splitlines()[2].startswith("| workload | floor ms | phase floor ms |")
    assert json.loads(bench_runs.render(record, variants, "json")) == record
    with pytest.raises(ValueError, match="fmt must be 'table', 'markdown' or 'json', got 'html'"):
        bench_runs.render(record, variants, "html")
    short = _record(rows, ["graphs"], layers=4)
    assert bench_runs.render(short, ["graphs"]).splitlines()[0] == "qwen3.5-9b (4 layers), bf16, NVIDIA H200"
    fp8 = {**short, "preset": "qwen3.5-9b-fp8"}
    assert bench_runs.render(fp8, ["graphs"]).splitlines()[0] == \
        "qwen3.5-9b-fp8 (4 layers), FP8 weights (128 x 128 blocks), bf16 activations, NVIDIA H200"


def test_profile_attributes_the_step_kernels_to_their_ops():
    """--profile's phases by kernel name (first match wins): our chunked GDN kernels and layout program, the
    attention's library kernels (FlashAttention-2's, cuDNN's generated SDPA kernels, which also contain GEMM
    substrings) and its merge kernel, before the GEMM patterns; conv1d's state kernel stays conv1d's."""
    gdn, attention = "gdn_recurrence (own kernels)", "paged_attention (own kernels)"
    expected = {
        "_gdn_chunk_intra_kernel": gdn, "_gdn_chunk_state_kernel": gdn, "_chunk_layout_kernel": gdn,
        "_gdn_recurrent_kernel": gdn, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": gdn,
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64, 64, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<256, 64, 64, 4, cutlass::bfloat16_t> >>": attention,
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0": attention,
        "_context_merge_kernel": attention, "_paged_decode_kernel": attention,
        "_conv1d_state_kernel": "causal_conv1d (own kernels)", "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "GEMM",
        "_block_fp8_gemv_kernel": "GEMM", "_block_fp8_splitk_kernel": "GEMM", "_splitk_sum_kernel": "GEMM",
        "void at::native::elementwise_kernel<128, 4>": profiling.OTHER,
    }
    assert {k: profiling.phase_of(k) for k in expected} == expected


def test_host_profile_names_where_a_steps_host_time_goes():
    from metrale_graph.tools.profiling import host_profile

    def inner():
        return sorted(range(20000), key=lambda i: -i)

    setups = []
    rows = host_profile(lambda: inner(), lambda: setups.append(1), runs=4, top=5)
    assert len(setups) == 4 and 1 <= len(rows) <= 5
    inner_row = next(r for r in rows if r["function"].startswith("inner ("))
    assert inner_row["calls"] == 1 and inner_row["cum_ms"] >= inner_row["self_ms"] >= 0
    assert rows == sorted(rows, key=lambda r: -r["cum_ms"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tools run")
def test_decode_tools_refuse_to_run_without_a_gpu(capsys):
    """bench_ops --decode and check_decode parse their flags and exit with a clear error on a CPU-only machine."""
    bench_ops, check_decode = benchmark_script("kernels/bench_ops"), benchmark_script("kernels/check_decode")

    for tool, argv in ((bench_ops, ["--decode", "1,32"]), (check_decode, ["--streams", "1"])):
        with pytest.raises(SystemExit) as e:
            tool.main(argv)
        assert e.value.code == 1 and "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_ops.main(["--decode", "0"])
    assert e.value.code == 2


def test_check_decode_refuses_short_streams_the_recurrent_kernel_does_not_take(capsys):
    """check_decode --short: streams of more than 64 tokens take the chunked path, not the recurrent kernel:
    a usage error naming the flag, before anything runs."""
    check_decode = benchmark_script("kernels/check_decode")

    with pytest.raises(SystemExit) as e:
        check_decode.main(["--short", "16,65"])
    assert e.value.code == 2 and "--short" in capsys.readouterr().err


@pytest.mark.parametrize("T", [1, 5, 40])
def test_check_moe_gemm_compares_the_same_pair_rows(T):
    """benchmarks/kernels/check_moe_gemm.py's path (aligned blocks and our grouped-GEMM kernels, Triton's
    interpreter) and its reference (a loop over the experts) give the same row per (token, expert) pair as a
    loop over the pairs; expert_bytes counts the experts T tokens touch."""
    tool = benchmark_script("kernels/check_moe_gemm")

    cfg = PRESETS["qwen3.5-35b-a3b"].replace(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                             hidden_size=48)
    ours = tool.case(cfg, T, "cpu", torch.float32, seed=T)
    want = torch.zeros(T * 3, 48)
    for p in range(T * 3):  # pair p = t * k + j: expert e's down(silu(gate) * up) of token t, times its weight
        t, e = divmod(p, 3)[0], int(ours.top_e.reshape(-1)[p])
        h = ours.n[t] @ ours.w13[e].T
        want[p] = (torch.nn.functional.silu(h[:32]) * h[32:]) @ ours.w2[e].T * ours.top_w.reshape(-1)[p]
    assert tool.rel(tool.pair_rows(ours), want) <= 1e-5
    assert tool.rel(tool.reference_rows(ours), want) <= 1e-5
    # the touched experts' weights in expectation: one token touches its k experts, many tokens all E
    assert tool.expert_bytes(1, 6, 3, 32, 48) == pytest.approx(3 * 3 * 32 * 48 * 2)
    assert tool.expert_bytes(10_000, 6, 3, 32, 48) == pytest.approx(6 * 3 * 32 * 48 * 2)


def test_check_gemv_times_the_products_kernel_on_a_presets_projections():
    """benchmarks/kernels/check_gemv.py times ops/gemv.py's kernel (tests/test_gemv.py checks it), not a copy of its
    own; its projections list names a preset's decode projections (the MoE's shared expert, not a dense MLP)."""
    tool = benchmark_script("kernels/check_gemv")

    assert tool.gemv.gemv is gemv.gemv and not hasattr(tool, "_gemv_kernel")
    names = [name for name, _, _ in tool.projections(PRESETS["qwen3.5-35b-a3b"])]
    assert "shared down" in names and "lm head" in names and "mlp down" not in names
    assert "mlp down" in [name for name, _, _ in tool.projections(PRESETS["qwen3.5-9b"])]


def test_check_moe_direct_forms_give_the_rows_kernels_act():
    """benchmarks/kernels/check_moe_direct.py's experimental gate|up forms (the next K step prefetched; K split over
    programs, then a finishing kernel) give ops/moe/direct.py's rows kernel's act, rounding included (Triton's
    interpreter, bf16), for each routing the timed call rotates through; its down at a forced tile equals the
    default one. (Its tl.dot forms are not run here: the interpreter's 16-bit dots are not the GPU's.)"""
    tool = benchmark_script("kernels/check_moe_direct")

    cfg = PRESETS["qwen3.5-35b-a3b"].replace(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                             hidden_size=128)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(6, 64, 128, generator=g).mul(0.1).to(torch.bfloat16)
    w2 = torch.randn(6, 128, 32, generator=g).mul(0.1).to(torch.bfloat16)
    c = tool.Case(cfg, 2, w13, w2)
    for i in (0, tool.ROTATE - 1):
        c.gate_up(i)
        want = c.act[i].clone()
        c.down(i)
        y = c.y[i].clone()
        c.down(i, (16, 32, 4))
        assert torch.equal(c.y[i], y)
        for form in (lambda: c.prefetch(i, 16, 32, 4),
                     lambda: c.split(i, 2, 16, 32, 4, torch.empty(2, 2, c.P, c.IE)),
                     lambda: c.split(i, 4, 16, 32, 4, torch.empty(4, 2, c.P, c.IE))):
            c.act[i].zero_()
            form()
            assert tool.rel(c.act[i], want) <= 1e-2, form  # (the K sums' order differs: bf16 rounding at most)
    two = tool.Case(cfg, 2, torch.cat([w13, w13.flip(0)]), torch.cat([w2, w2.flip(0)]), layers=2)  # --layers 2
    assert all(bool((e // 6 == i % 2).all()) for i, e in enumerate(two.e))  # routing i: layer i % 2's experts
    two.gate_up(1)
    one = tool.Case(cfg, 2, w13.flip(0), w2.flip(0))
    one.e[1] = two.e[1] - 6
    one.x[1] = two.x[1]
    one.gate_up(1)
    assert torch.equal(two.act[1], one.act[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tool runs")
def test_check_moe_gemm_refuses_without_a_gpu_or_a_moe_preset(capsys):
    tool = benchmark_script("kernels/check_moe_gemm")

    with pytest.raises(SystemExit) as e:
        tool.main(["--presets", "qwen3.5-9b"])
    assert e.value.code == 2 and "qwen3.5-9b" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tool.main(["--tokens", "4"])
    assert e.value.code == 1 and "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_record_names_the_kernel_choices(monkeypatch):
    """The JSON says which backend each switchable kernel ran with (the env switches read at import), so an
    A/B's two records tell themselves apart."""
    import argparse

    from metrale_graph.ops import gdn_recurrence
    from metrale_graph.ops.fp8 import linear

    args = argparse.Namespace(preset="qwen3.5-9b-fp8", tp=1, repeat=3)
    monkeypatch.setattr(gdn_recurrence, "CHUNKED_BACKEND", "fla")
    monkeypatch.setattr(linear, "DECODE_GEMM", "w8a16")
    record = bench_runs.bench_record(args, 32, None, "NVIDIA H200", {"commit": "x"}, [])
    assert record["backends"] == {"gdn_chunked": "fla", "fp8_decode": "w8a16"}


def test_projection_arithmetic_at_published_acceptance():
    """vLLM's per-position rates are unconditional (position 2 counts only when 1 was kept): a step emits the bonus
    token plus their sum, 1 + 0.80 + 0.43 = 2.23 tokens a stream (its published acceptance length)."""
    from metrale_graph.tools import bench_speculative as bs

    assert bs.acceptance_length(bs.PUBLISHED["per_position"]) == pytest.approx(2.23)
    row = bs.project(8, step_ms=10.0, plain_ms=6.0)
    assert row["projected_tok_s"] == pytest.approx(8 * 2.23 / 10.0 * 1e3, abs=0.05)
    assert row["plain_tok_s"] == pytest.approx(8 / 6.0 * 1e3, abs=0.05)
    assert row["speedup"] == pytest.approx(2.23 * 6.0 / 10.0, abs=1e-3) and row["k"] == 2
    for bad in ([0.4, 0.8], [1.2], [-0.1]):  # a later position cannot be kept more often than an earlier one
        with pytest.raises(ValueError, match="per-position acceptance rates"):
            bs.acceptance_length(bad)


def test_echo_prompts_and_the_engines_buckets():
    from metrale_graph.tools import bench_speculative as bs

    assert bs.echo_prompts([[1, 2], [3]], [[7, 8, 9], [4]]) == [[1, 2, 7, 8, 9, 1, 2], [3, 4, 3]]
    with pytest.raises(ValueError, match="2 prompts for 1 continuations"):
        bs.echo_prompts([[1], [2]], [[3]])
    # every step a window replays has its bucket: plain decodes (n), verifies (n x (k + 1)), prompt chunks beside them
    batch_sizes, tokens = bs.engine_grid([1, 8], (1, 3), 2048)
    assert batch_sizes == [1, 8] and tokens == [1, 2, 4, 8, 16, 32, 2048, 2051, 2072]
    plan = bs.SpecPlan(streams=(32,), context=2048, steps=32, settle=4)
    # 32 x 2048 prompt tokens at 2048 a step: 32 steps (+2) before the last decodes, then 2 windows, 4 tokens a step
    assert bs.window_tokens(plan, 32, phases=2, k=3) == (34 + 2 * (4 + 32 + bs.SLACK)) * 4


def test_speculative_flags(capsys):
    from metrale_graph.tools import bench_speculative as bs

    p = bench._parser()
    args = p.parse_args(["--preset", "tiny", "--speculative", "1,8", "--speculative-k", "3,1", "--echo", "16"])
    plan = bench._plan(p, args)
    assert plan.workloads == [] and plan.spec == bs.SpecPlan(streams=(1, 8), ks=(1, 3), mtp_k=2, echo=(16,))
    assert bs.model_config(plan.cfg, plan.spec).mtp_num_hidden_layers == 1  # a random head for the MTP engine
    assert bench._plan(p, p.parse_args(["--preset", "tiny"])).spec is None
    only_echo = bench._plan(p, p.parse_args(["--preset", "tiny", "--echo", "1", "--workloads", "D1"]))
    assert only_echo.workloads == ["D1"] and not only_echo.spec.needs_mtp
    assert bs.model_config(only_echo.cfg, only_echo.spec) is only_echo.cfg
    for argv, message in ((["--speculative", "1,1"], "names a value twice"),
                          (["--speculative", "1", "--tp", "2"], "leave them out under --tp"),
                          (["--speculative", "0"], "positive integers"),
                          (["--speculative-mtp-k", "-1"], "non-negative"),
                          (["--speculative-k", "2"], "give one of them too"),
                          (["--echo", "1", "--speculative-mtp-k", "1"], "give --speculative too"),
                          (["--trace", "t"], "give one of them too"),
                          (["--echo", "1", "--trace", "t"], "give --speculative too")):
        with pytest.raises(SystemExit) as e:
            bench._plan(p, p.parse_args(["--preset", "tiny", *argv]))
        assert e.value.code == 2 and message in capsys.readouterr().err, argv


def test_speculative_workloads_run_on_the_cpu():
    """The whole driver on the tiny preset, eager on the CPU (times are not asserted): the plain engine's windows,
    the n-gram engine's phases with drafts forced to k, the MTP engine's with its drafter timed, the echo workload
    and the projection; the record's shape, and counters that follow from the forcing."""
    from metrale_graph.speculative import drafting, mtp, verify
    from metrale_graph.tools import bench_speculative as bs

    plan = bs.SpecPlan(streams=(2,), ks=(1, 2), mtp_k=2, echo=(2,), context=6, steps=2, settle=2, echo_prompt=5,
                       echo_new=6, host_top=5)
    model = HybridModel.from_preset(bs.model_config(PRESETS["tiny"], plan), seed=0)
    logged = []
    spec = bs.run_speculative(model, plan, compile=False, log=logged.append)
    # the hooks are undone: prompt lookup and the MTP head's step are the package's own again
    assert verify.ngram_propose.__module__ == "metrale_graph.speculative.proposers"
    assert drafting.mtp_hidden_states is mtp.mtp_hidden_states
    assert set(spec) == {"setup", "verify", "echo", "projection"}
    assert spec["setup"]["forced"] == bs.FORCED and spec["setup"]["published"] == bs.PUBLISHED
    assert [(r["engine"], r["k"]) for r in spec["verify"]] == [("plain", 0), ("ngram, forced drafts", 0),
                                                               ("ngram, forced drafts", 1), ("ngram, forced drafts", 2),
                                                               ("mtp", 2)]
    assert len(logged) == 6 and all(r in logged for r in spec["verify"] + spec["echo"])  # as each was measured
    # the engine loop's host functions, sampled per window: [function, inclusive ms, self ms] a step, the 5 largest
    # by inclusive and the 5 by self time
    tops = [r["host_top"] for r in spec["verify"]]
    assert all(len(t) <= 10 and all(isinstance(f, str) and incl >= own >= 0 for f, incl, own in t) for t in tops)
    assert any(any(f.startswith("_run (loop") for f, _, _ in t) for t in tops), tops  # the loop thread's own
    for r in spec["verify"]:
        n, k = r["streams"], r["k"]
        assert r["steps"] >= plan.steps and r["device_ms"] is None  # (no CUDA: no device time)
        # 1 .. k + 1 tokens a stream and step, but for a step the counters' read may cut at each end
        assert (r["steps"] - 1) / r["steps"] <= r["tokens_per_step"] <= (k + 1) * (r["steps"] + 1) / r["steps"]
        # every step verifies k drafts of each stream (one step of slack: the phase switch, the counters' read)
        assert abs(r["proposed"] - r["steps"] * n * k) <= n * k and r["accepted"] <= r["proposed"]
        assert (r["verify_steps"] == 0) == (k == 0)
    mtp_row = spec["verify"][-1]
    # a draft call per step, k drafts a stream; in each, the catch-up then k - 1 single-token head steps
    assert abs(mtp_row["draft_calls"] - mtp_row["steps"]) <= 1 and mtp_row["draft_tokens"] == mtp_row["draft_calls"] * 2 * 2
    assert mtp_row["draft_ms_per_step"] > 0 and mtp_row["draft_catchup_ms"] > 0 and mtp_row["draft_head_step_ms"] > 0
    for r in spec["echo"]:
        assert r["prompt_tokens"] == 2 * 5 + 6 and r["new_tokens"] == 6
        assert r["same_output"] == 1.0  # greedy speculation gives plain decoding's tokens (fp32)
        # the bigram weights continue P with C again, and prompt lookup's drafts are that chain: all kept
        assert r["echoed"] == 1.0 and r["accepted"] == r["proposed"] > 0
    # at the published k = 2: the MTP engine's step, and the forced verify step plus the MTP drafting
    step = spec["verify"][3]["step_ms"]
    assert [(r["from"], r["step_ms"]) for r in spec["projection"]] == [
        ("MTP engine step", mtp_row["step_ms"]),
        ("forced verify + MTP draft", round(step + mtp_row["draft_ms_per_step"], 3))]
    proj = spec["projection"][1]
    assert proj["projected_tok_s"] == pytest.approx(2 * 2.23 / proj["step_ms"] * 1e3, abs=0.1)
    (alone,) = bs.projections(spec["verify"][:-1], plan)  # without the MTP engine: the verify step alone
    assert alone["from"] == "forced verify step (no draft)" and alone["step_ms"] == step
    text = bs.render(spec)
    assert "PROJECTION, not a measurement" in text and bs.FORCED in text and "echoed C" in text and "catch-up" in text
    assert "the engine loop's host time a step" in text


def test_draft_timer_counts_the_catch_ups_of_ending_requests_apart(monkeypatch):
    """With prefix caching the MTP head also catches up, drafting nothing, on the last step of each request the step
    ends (drafting.MtpDrafter.catch_up_ending, outside the draft calls). DraftTimer counted those head runs as further
    draft steps (the runs after a draft call's first): draft_head_step_ms averaged catch-ups in. They are now counted
    apart (ending_runs, ending_ms), and the draft figures hold the draft calls' runs alone, counted here beneath it."""
    from helpers import random_tokens, tiny_config
    from speculative_reference import bigram_model
    from metrale_graph import Engine
    from metrale_graph.speculative import drafting
    from metrale_graph.tools.engine_windows import DraftTimer

    real_head, real_draft, real_ending = drafting.mtp_hidden_states, MtpDrafter.draft, MtpDrafter.catch_up_ending
    where, runs = [], {"draft": [], "ending": 0}

    def head(*args, **kwargs):  # beneath the timer's hooks: the call each head run belongs to
        if where[-1] == "ending":
            runs["ending"] += 1
        else:
            runs["draft"][-1] += 1
        return real_head(*args, **kwargs)

    def draft(self, *args, **kwargs):
        where.append("draft")
        runs["draft"].append(0)
        try:
            return real_draft(self, *args, **kwargs)
        finally:
            where.pop()

    def ending(self, *args, **kwargs):
        where.append("ending")
        try:
            return real_ending(self, *args, **kwargs)
        finally:
            where.pop()

    monkeypatch.setattr(drafting, "mtp_hidden_states", head)
    monkeypatch.setattr(MtpDrafter, "draft", draft)
    monkeypatch.setattr(MtpDrafter, "catch_up_ending", ending)
    model = bigram_model(tiny_config(mtp_num_hidden_layers=1))
    lengths = (7, 16, 11)  # requests ending at different steps while the others draft on
    with Engine(model, 3, compile=False, prefix_cache=True, speculative={"method": "mtp", "num_tokens": 3}) as engine:
        with DraftTimer(engine) as timer:
            handles = [engine.submit(random_tokens(20, s, model.config.vocab_size), max_new_tokens=n, stop_token_ids=[])
                       for s, n in enumerate(lengths)]
            assert [len(h.result(60).token_ids) for h in handles] == list(lengths)
        drafter = engine._loop.spec.mtp
        assert not {"draft", "catch_up_ending"} & set(vars(drafter)) and drafting.mtp_hidden_states is head
    ms, calls, tokens, catchup_ms, step_ms, head_steps = timer.totals()
    assert runs["ending"] == len(lengths) and calls == len(runs["draft"]) > 0  # (each request's end caught up on)
    assert head_steps == sum(n - 1 for n in runs["draft"] if n) > 0 and step_ms > 0 and catchup_ms > 0
    assert timer.ending_runs == runs["ending"] and timer.ending_ms > 0


def test_bench_part_writes_each_row_as_it_comes(monkeypatch, tmp_path):
    """tools.bench's call of the speculative workloads: a run cut short (an engine that does not fit, say) keeps the
    rows measured before it in --json; at the end the part is the record's "speculative"."""
    from metrale_graph.tools import bench_speculative as bs

    path, rows = tmp_path / "spec.json", [{"engine": "plain", "streams": 1}, {"engine": "mtp", "streams": 1}]
    seen = []

    def run(model, plan, seed, log):
        for i, row in enumerate(rows):
            log(row)
            seen.append(json.loads(path.read_text()))
        return {"setup": {}, "verify": [], "echo": [], "projection": []}

    monkeypatch.setattr(bs, "run_speculative", run)
    record = {"tool": "bench", "results": []}
    assert bs.bench_part(None, bs.SpecPlan(streams=(1,)), 0, record, str(path)) == ""
    assert [s["speculative_rows_so_far"] for s in seen] == [rows[:1], rows]
    assert seen[0]["tool"] == "bench" and record["speculative"]["verify"] == []


def test_profile_attributes_every_moe_kernel_to_the_op():
    """Every Triton kernel of the MoE op's packages (bf16 and FP8, sort and align included) is counted under the
    op by `bench --profile`, not under "other": the counting sort was not (its name matched no substring)."""
    import pathlib
    import re

    from metrale_graph.ops import REGISTRY, moe

    ops = pathlib.Path(moe.__file__).resolve().parents[1]
    names = [n for f in [*(ops / "moe").glob("*.py"), *(ops / "fp8").glob("experts*.py")]
             for n in re.findall(r"^def (_moe_\w+_kernel)\(", f.read_text(), re.M)]
    assert "_moe_count_sort_kernel" in names and len(names) >= 12
    patterns = REGISTRY["moe"].kernels
    assert [n for n in names if not any(p in n for p in patterns)] == []
