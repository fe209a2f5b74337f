"""Shared test helpers: random configs, transformers reference models, error metrics."""

from __future__ import annotations

import torch

from metrale_graph.config import ModelConfig, default_layer_types


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:  # nothing to compare (and no norm to divide by)
        return
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative norm error {err:.3e} > {tol:.1e}"


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # each op vs its reference on upcast inputs

# A token's routing is decided when its k-th and (k+1)-th router logits (the upcast reference's) differ
# by more than one ulp of the model dtype at that magnitude (closer logits may round to one value, a
# tie topk breaks either way) plus twice what the model-dtype input of the router may move a logit
# (bf16: normed input rounded, logits of std ~1).
ROUTING_SLACK = {torch.float32: 1e-5, torch.bfloat16: 6e-3}
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7}


def moe_decided_rows(args, dtype) -> torch.Tensor:
    """[T] bool: the tokens of metrale::moe's arguments whose top-k experts the upcast reference picks
    with a margin no rounding in `dtype` can undo. Routing is discontinuous: a token on a near tie may
    take either expert, both right, their outputs one expert's weighted output apart (measured: bf16
    routing breaks 9 of 384 tokens' ties otherwise than fp32 at 256 experts, top 8); those tokens are
    left out of the comparison."""
    import torch.nn.functional as F

    from metrale_graph.ops.common import rms_norm

    from metrale_graph.ops import REGISTRY, declaration

    a = declaration(REGISTRY["moe"].op).Args(*args)
    h, norm_w, router_w, top_k, eps = (a.h.detach().cpu().float(), a.norm_w.cpu().float(), a.router_w.cpu().float(),
                                      a.top_k, a.eps)
    if top_k == router_w.shape[0]:
        return torch.ones(h.shape[0], dtype=torch.bool)
    logits = F.linear(rms_norm(h, norm_w, eps), router_w)
    top = logits.topk(top_k + 1, dim=-1).values
    kth, next_ = top[:, top_k - 1], top[:, top_k]
    _, exponent = torch.frexp(torch.maximum(kth.abs(), next_.abs()))
    ulp = torch.ldexp(torch.ones_like(kth), exponent - 1 - MANTISSA_BITS[dtype])
    return kth - next_ > ulp + ROUTING_SLACK[dtype]


def compared_rows(name, args, dtype):
    """Rows of an op's outputs to compare with its reference (None: all); see moe_decided_rows."""
    return moe_decided_rows(args, dtype) if name == "moe" else None


def round_bf16_to_nearest(monkeypatch) -> None:
    """Triton's interpreter casts fp32 to bf16 by truncation; the GPU rounds to nearest even. Truncation's
    bias adds up over the sums of a chunked kernel (measured: 4x the GPU's rounding error), so round like
    the GPU (for this test, through monkeypatch). No interpreter: nothing to correct."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    convert = interpreter._convert_float

    def rounded(data, src, dst, rounding_mode):
        if rounding_mode is None and src == tl.float32 and dst == tl.bfloat16:
            bits = data.astype(np.float32).view(np.uint32).astype(np.uint64)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return convert(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", rounded)


def upcast(args):
    """Floating-point tensors in fp32; FP8 weights (float8_e4m3fn, their scales fp32 already) as they are."""
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float8_e4m3fn
            else a for a in args]


def clone_args(args, device):
    return [a.clone().to(device) if isinstance(a, torch.Tensor) else a for a in args]


def outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _shares_memory(a, b):
    """Same storage (what torch's custom-op alias check compares: empty views count too), or, for
    non-empty tensors, the same storage address."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa._cdata == sb._cdata or (a.numel() > 0 and b.numel() > 0 and sa.data_ptr() == sb.data_ptr())


def assert_no_aliasing(name, outputs, inputs):
    """No output shares memory with another output or with any input (custom-op contract)."""
    inputs = [a for a in inputs if isinstance(a, torch.Tensor)]
    for i, o in enumerate(outputs):
        for j, other in enumerate(outputs[i + 1:], i + 1):
            assert not _shares_memory(o, other), f"{name}: outputs {i} and {j} share memory"
        for j, a in enumerate(inputs):
            assert not _shares_memory(o, a), f"{name}: output {i} shares memory with tensor input {j}"


def run_step(model, step, cache, streams) -> torch.Tensor:
    """model.prefill with `step` (e.g. a compiled forward_packed) in the place of the eager step: the same
    prefill protocol (metrale_graph/protocol.py) around `step(cache, packed)`."""
    from metrale_graph.protocol import prefill_call

    with torch.no_grad(), prefill_call(model, cache, streams) as call:
        return call.run(lambda packed: step(cache, packed))


def packed_batch(model, cache, streams):
    """The PackedBatch a prefill of `streams` hands its step (through the prefill protocol: validated, KV
    blocks reserved; the step itself writes nothing, the slots' contexts advance as after a prefill)."""
    from metrale_graph.protocol import prefill_call

    seen = []

    def record(packed):
        seen.append(packed)
        return torch.zeros(packed.num_streams, 1)

    with prefill_call(model, cache, streams) as call:
        call.run(record)
    return seen[0]


def unit_gain(model, seed: int):
    """Overwrite, in place, every matrix of `model` (every parameter of 2 or more dims but the GDN conv1d
    kernels) by randn * in_features**-0.5 (unit gain, as hf_reference) drawn from its own `seed`; returns
    the model. random_weights' std 0.02 (transformers' initializer_range) shrinks each layer's share of the
    residual stream and the spread of the GDN gates (a state outlives a token or two), which blunts
    comparisons of two paths of one model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


def random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    """n token ids drawn with their own seed (512: the tiny preset's vocabulary)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tiny_config(**overrides) -> ModelConfig:
    """A small random-shape config; overrides change any field."""
    base = dict(vocab_size=256, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                layer_types=default_layer_types(4), num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, partial_rotary_factor=0.5, rope_theta=10000.0, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                max_position_embeddings=2048)
    base.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        base["layer_types"] = default_layer_types(base["num_hidden_layers"])
    return ModelConfig(**base)


def moe_config(model_type: str = "qwen3_5_moe_text", **overrides) -> ModelConfig:
    """A small random-shape MoE config of a family (qwen3_5_moe_text or qwen3_next): 5 experts,
    top-3, expert / shared-expert intermediate sizes 20 / 12; overrides change any field."""
    moe = dict(model_type=model_type, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=20,
               shared_expert_intermediate_size=12)
    if model_type == "qwen3_5_moe_text":
        moe["intermediate_size"] = 0  # no dense MLP in Qwen3.5-MoE
    return tiny_config(**{**moe, **overrides})


def hf_class(cfg: ModelConfig):
    """transformers' causal-LM class of the config's family."""
    import transformers

    return getattr(transformers, cfg.family.causal_lm_class)


def hf_reference(cfg: ModelConfig, seed: int = 0, multimodal: bool = False):
    """A transformers model of `cfg` (Qwen3.5, Qwen3.5-MoE or Qwen3-Next, by cfg.model_type) in fp32
    with every weight random (norm weights too, so the zero-centred (1 + w) convention is
    exercised; routers and experts too). MoE experts run transformers' eager per-expert loop."""
    import transformers

    hf_cfg, family = cfg.to_hf(), cfg.family
    torch.manual_seed(seed)
    if multimodal:
        (wrapper,) = family.multimodal
        mm_cls, mm_model_cls = getattr(transformers, wrapper.config_class), getattr(transformers, wrapper.model_class)
        mm = mm_cls(
            text_config=hf_cfg, tie_word_embeddings=cfg.tie_word_embeddings,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                               out_hidden_size=cfg.hidden_size))
        model = mm_model_cls(mm)
    else:
        model = getattr(transformers, family.causal_lm_class)(getattr(transformers, family.config_class)(**hf_cfg))
    if cfg.num_experts:
        model.set_experts_implementation("eager")  # not grouped_mm & co: the reference loop, in fp32
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.float().eval()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits [L, vocab] of one stream run alone through transformers."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


PARITY_LENGTHS = [1, 63, 64, 65, 130]


def random_streams(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def check_parity(model, hf, cfg, lengths=PARITY_LENGTHS, tol: float = 1e-4) -> float:
    """Prefill the streams as one batch (slots not 0..B-1, to catch slot mix-ups); each stream's last
    logits against transformers run on it alone. Returns the largest relative error."""
    from metrale_graph import Stream

    cache = model.new_cache(num_slots=len(lengths) + 2, num_blocks=64, block_size=16)
    streams = random_streams(cfg.vocab_size, lengths)
    slots = [len(lengths) + 1 - i for i in range(len(lengths))]
    out = model.prefill(cache, [Stream(s, t) for s, t in zip(slots, streams)])
    assert out.shape == (len(lengths), cfg.vocab_size)
    worst = 0.0
    for i, tokens in enumerate(streams):
        err = rel_err(out[i], hf_logits(hf, tokens)[-1])
        assert err <= tol, f"stream {i} (length {lengths[i]}): relative error {err:.2e} > {tol:.0e}"
        worst = max(worst, err)
    return worst


def replay_memory_growth(runner, vocab: int, replays: int = 1000, seed: int = 1) -> tuple[int, int]:
    """(allocated, reserved) bytes the CUDA caching allocator gained over `replays` random batches through
    `runner` (1-8 streams in random slots, up to 1024 tokens together, slots reset before they pass 900
    tokens of context), after 20 batches of warm-up; both <= 0 when replaying grows nothing."""
    from metrale_graph import Stream

    cache, g = runner.cache, torch.Generator().manual_seed(seed)
    for s in range(cache.num_slots):
        cache.reset(s)

    def one():
        n = int(torch.randint(1, 9, (1,), generator=g))
        slots = torch.randperm(cache.num_slots, generator=g)[:n].tolist()
        for s in slots:
            if cache.context_lens[s] > 900:
                cache.reset(s)
        lengths = torch.randint(1, 1024 // n + 1, (n,), generator=g).tolist()
        runner.prefill([Stream(s, torch.randint(0, vocab, (L,), generator=g)) for s, L in zip(slots, lengths)])

    for _ in range(20):
        one()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for _ in range(replays):
        one()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - allocated, torch.cuda.memory_reserved() - reserved


def run_torchrun(nproc: int, args: list[str], cwd: str | None = None, timeout: int = 600):
    """`torchrun --nproc-per-node nproc <args>` on a free port (a fixed one collides with another run on the
    same machine); asserts it succeeded, with the error lines of its standard error in the message (the first
    and the last 60 when there are more: a rank's own traceback comes long before torchrun's summary, which
    alone fills the tail)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONFAULTHANDLER="1")  # a rank that aborts prints where each of its threads was
    done = subprocess.run([torchrun, "--nproc-per-node", str(nproc), "--master-port", str(port), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        marks = ("Error", "error:", "terminate", "what()", "Traceback", "Abort", "rank", "Fatal", "Thread", "File")
        errors = [line for line in done.stderr.splitlines() if any(m in line for m in marks)]
        if len(errors) > 120:
            errors = errors[:60] + ["..."] + errors[-60:]
        raise AssertionError(f"torchrun exited {done.returncode}\nerror lines:\n" + "\n".join(errors)
                             + "\n--- stdout tail ---\n" + done.stdout[-800:] + "\n--- stderr tail ---\n"
                             + done.stderr[-1500:])
    return done
