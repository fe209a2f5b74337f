"""The floor model of tools.bench and benchmarks/kernels/bench_ops.py: the least time a step (or one op) can
take on an H200, from the matrix FLOPs it must do and the bytes it must move (docs/benchmarking.md, "Floors").

A step is split into phases in the order the step runs them: per layer the mixer's projections, its
core (GDN conv and recurrence, or attention over the cache) and its output projection, then the
feed-forward half (a dense MLP, or an MoE layer's router + shared expert and its routed experts); the
embedding lookup before the layers, the final norm and LM head after. Each phase's input is the
previous one's output, so they run one after another. Two floors:

- `floor_ms`: max(all FLOPs / MATMUL_RATE + FP8 FLOPs / FP8_MATMUL_RATE, all bytes / COPY_RATE), as if
  the compute-bound and the memory-bound phases could overlap perfectly;
- `phase_floor_ms`: the sum over phases of each phase's max, since they cannot.

The phases partition the step's FLOPs and bytes, so phase_floor_ms >= floor_ms always. An FP8 model
(config.quantization): its FP8 weights count one byte an element and their block scales four, and the
GEMMs over them run at the FP8 rate (the FLOPs of the others, and attention's, at the bf16 rate).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# The H200's two ceilings, measured there (docs/benchmarking.md): bf16 dense matrix rate, and device-to-device
# copy bandwidth counting bytes read plus bytes written.
MATMUL_RATE = 790e12
# FP8 dense matrix rate (e4m3 x e4m3, fp32 accumulate): cuBLAS at 8192^3 on the H200, 1274 TFLOP/s with one
# scale per tensor, 1142 with 1x128 x 128x128 block scales; the higher, as a floor errs low
FP8_MATMUL_RATE = 1274e12
COPY_RATE = 4.3e12
WEIGHT_BYTES = 2  # bf16 weights, activations, conv states, K/V and logits
STATE_BYTES = 4  # the GDN states are float32

# phase kinds, in the order a layer runs them
EMBEDDING = "embedding"
GDN_PROJ, GDN_CONV, GDN_RECURRENCE, GDN_OUT = "GDN projections", "GDN conv", "GDN recurrence", "GDN output"
ATTN_PROJ, ATTENTION, ATTN_OUT = "attention projections", "attention", "attention output"
MLP, ROUTER, EXPERTS = "MLP", "router + shared expert", "experts"
HEAD = "final norm + LM head"
KINDS = (EMBEDDING, GDN_PROJ, GDN_CONV, GDN_RECURRENCE, GDN_OUT, ATTN_PROJ, ATTENTION, ATTN_OUT, MLP, ROUTER,
         EXPERTS, HEAD)


def floor_ms(flops: float, nbytes: float, fp8_flops: float = 0.0) -> tuple[float, str]:
    """(ms, "compute" or "memory"): the larger of FLOPs at MATMUL_RATE plus FP8 FLOPs at FP8_MATMUL_RATE,
    and bytes at COPY_RATE."""
    compute = (flops / MATMUL_RATE + fp8_flops / FP8_MATMUL_RATE) * 1e3
    memory = nbytes / COPY_RATE * 1e3
    return max(compute, memory), "compute" if compute >= memory else "memory"


@dataclass(frozen=True)
class Phase:
    """One phase of a step: `kind` (one of KINDS) of `layer` (None for the embedding and the head);
    `flops` at the bf16 rate, `fp8_flops` (GEMMs over FP8 weights) at the FP8 rate."""
    kind: str
    layer: int | None
    flops: float
    bytes: float
    fp8_flops: float = 0.0

    @property
    def ms(self) -> float:
        return floor_ms(self.flops, self.bytes, self.fp8_flops)[0]


@dataclass(frozen=True)
class StepFloor:
    """A step's floors (ms, on `gpus` GPUs), its FLOPs (bf16-rate and FP8) and bytes (all GPUs together) and
    its phases."""
    floor_ms: float
    phase_floor_ms: float
    flops: float
    bytes: float
    phases: tuple[Phase, ...]
    fp8_flops: float = 0.0

    def by_kind(self, gpus: int = 1) -> dict[str, float]:
        """kind -> phase floor ms summed over the layers, in KINDS order (kinds the model lacks left out)."""
        out: dict[str, float] = {}
        for kind in KINDS:
            ms = [floor_ms(p.flops / gpus, p.bytes / gpus, p.fp8_flops / gpus)[0] for p in self.phases
                  if p.kind == kind]
            if ms:
                out[kind] = sum(ms)
        return out


def expected_experts(cfg, tokens: int) -> float:
    """Experts of one MoE layer that `tokens` tokens touch, in expectation under uniform routing."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def phase_of(cfg, name: str) -> tuple[str, int | None]:
    """(kind, layer) of the phase that reads weight `name` (a name of spec.weight_shapes); ValueError
    for a weight no phase reads (a new family's weight the floor model does not know yet)."""
    if name == "embed_tokens.weight":
        return EMBEDDING, None
    if name in ("norm.weight", "lm_head.weight"):
        return HEAD, None
    m = _LAYER.fullmatch(name)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        gdn = i in cfg.linear_layers
        if rest == "input_layernorm.weight":
            return (GDN_PROJ if gdn else ATTN_PROJ), i
        if rest == "post_attention_layernorm.weight":
            return (ROUTER if i in cfg.moe_layers else MLP), i
        if rest.startswith("linear_attn."):
            part = rest.removeprefix("linear_attn.")
            if part.startswith("conv1d."):
                return GDN_CONV, i
            return (GDN_OUT if part.startswith(("norm.", "out_proj.")) else GDN_PROJ), i
        if rest.startswith("self_attn."):
            return (ATTN_OUT if rest.startswith("self_attn.o_proj.") else ATTN_PROJ), i
        if rest.startswith("mlp.experts."):
            return EXPERTS, i
        if rest.startswith("mlp."):
            return (ROUTER if i in cfg.moe_layers else MLP), i
    raise ValueError(f"the floor model does not know which phase reads weight {name!r}")


def step_phases(cfg, new: tuple[int, ...], cached: tuple[int, ...]) -> list[Phase]:
    """The phases of one step of streams with `new` tokens after `cached` ones (one GPU, bf16).

    FLOPs: every projection over every new token (the conv1d's depthwise filter is no matrix product and
    is left out; an MoE layer: the router, the top-k experts and the shared expert), the GDN state's
    read, correction and update (3 x 2 K V per new token and value head, in the recurrent and the
    chunked form alike), causal attention over cached + new tokens, the LM head over each stream's last
    token. Bytes: every weight read once, except the embedding table, of which a lookup reads the T
    rows of the new tokens (MoE: only the experts the tokens touch, in expectation); the cached K/V
    read and the new K/V written; the GDN and conv states of each stream read and written; the logits
    written. Activations between phases are not counted: they may stay in L2 or in registers of a
    fused kernel, and a floor counts only what every implementation must move. FP8 weights (spec.fp8):
    one byte an element, their scales four, their GEMMs' FLOPs FP8 (Phase.fp8_flops).
    """
    from metrale_graph.spec import SCALE, model_spec

    T, B = sum(new), len(new)
    totals: dict[tuple[str, int | None], list[float]] = {}  # (kind, layer) -> [flops, bytes, fp8 flops]
    experts_touched = expected_experts(cfg, T) / cfg.num_experts if cfg.moe_layers else 0.0
    specs = model_spec(cfg)
    shapes = {name: s.shape for name, s in specs.items()}
    for name, shape in shapes.items():
        kind, layer = phase_of(cfg, name)
        spec = specs[name]
        n = math.prod(shape)
        size = 1 if spec.fp8 else 4 if spec.kind == SCALE else WEIGHT_BYTES
        flops = 2 if spec.kind != SCALE else 0  # per weight element and token
        acc = totals.setdefault((kind, layer), [0.0, 0.0, 0.0])
        if kind == EMBEDDING:
            acc[1] += T * shape[-1] * WEIGHT_BYTES
        elif kind == HEAD:
            acc[1] += n * size
        elif kind == EXPERTS:  # [E, ...]: each token runs top-k of the E experts
            acc[2 if spec.fp8 else 0] += flops * T * n * cfg.num_experts_per_tok / cfg.num_experts
            acc[1] += n * size * experts_touched
        else:
            acc[2 if spec.fp8 else 0] += flops * T * n if len(shape) >= 2 and kind != GDN_CONV else 0.0
            acc[1] += n * size
    head_rows = shapes.get("lm_head.weight", shapes["embed_tokens.weight"])[0]  # tied: the embedding table
    if "lm_head.weight" not in shapes:
        totals[(HEAD, None)][1] += head_rows * cfg.hidden_size * WEIGHT_BYTES
    totals[(HEAD, None)][0] += 2 * B * head_rows * cfg.hidden_size
    totals[(HEAD, None)][1] += B * cfg.vocab_size * WEIGHT_BYTES  # the logits

    HV, K, V = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * WEIGHT_BYTES  # one token's K and V, one layer
    pairs = sum(n * c + n * (n + 1) / 2 for n, c in zip(new, cached))
    core = {}
    for i in cfg.linear_layers:
        conv_channels = 2 * cfg.linear_num_key_heads * K + HV * V
        core[(GDN_CONV, i)] = (0.0, 2 * B * conv_channels * (cfg.linear_conv_kernel_dim - 1) * WEIGHT_BYTES)
        core[(GDN_RECURRENCE, i)] = (6 * T * HV * K * V, 2 * B * HV * K * V * STATE_BYTES)
    for i in cfg.full_layers:
        core[(ATTENTION, i)] = (4 * cfg.num_attention_heads * cfg.head_dim * pairs, kv_row * (sum(cached) + T))
    for key, (flops, nbytes) in core.items():
        acc = totals.setdefault(key, [0.0, 0.0, 0.0])
        acc[0] += flops
        acc[1] += nbytes

    def position(key):  # the order the step runs them: the embedding, each layer's phases, the head
        kind, layer = key
        if layer is None:
            return (-1 if kind == EMBEDDING else cfg.num_hidden_layers, 0)
        return (layer, KINDS.index(kind))

    return [Phase(kind, layer, *totals[(kind, layer)]) for kind, layer in sorted(totals, key=position)]


def step_floor(cfg, new: tuple[int, ...], cached: tuple[int, ...], gpus: int = 1) -> StepFloor:
    """The floors of one step (step_phases) on `gpus` GPUs: each GPU does its share of every phase's
    FLOPs and bytes (collectives not counted)."""
    phases = step_phases(cfg, new, cached)
    flops, nbytes, fp8 = (sum(p.flops for p in phases), sum(p.bytes for p in phases), sum(p.fp8_flops for p in phases))
    phase_ms = sum(floor_ms(p.flops / gpus, p.bytes / gpus, p.fp8_flops / gpus)[0] for p in phases)
    return StepFloor(floor_ms(flops / gpus, nbytes / gpus, fp8 / gpus)[0], phase_ms, flops, nbytes, tuple(phases), fp8)
