"""Random inputs for every phase op, over shape cases with ragged lengths (not multiples of
64, a single-token stream, a zero-length padding stream, one stream of one token, no tokens at
all), grouped value heads, dk != dv, and sizes that are not powers of two (head dims, rotary
dims, head ratios, KV block sizes). Dims stay tiny: opcheck runs every op on every case."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]
    context: tuple[int, ...]  # tokens already cached per stream
    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 24
    D: int = 32
    I: int = 40
    HQ: int = 4
    HKV: int = 2
    HD: int = 16
    R: int = 8  # rotary dim
    W: int = 4
    BS: int = 16
    num_slots: int = 6  # + 1 scratch
    num_blocks: int = 24  # + 1 null

    @property
    def id(self):
        return (f"L{'-'.join(map(str, self.lengths))}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}"
                f"-HQ{self.HQ}-HKV{self.HKV}-HD{self.HD}-R{self.R}-W{self.W}-BS{self.BS}")


CASES = [
    Case(lengths=(1, 63, 65), context=(0, 5, 0)),
    Case(lengths=(64, 7, 0), context=(3, 0, 0), H=2, HV=2, K=8, V=8, HQ=2, HKV=2),
    Case(lengths=(130,), context=(17,), H=1, HV=3, K=8, V=20, HD=32, R=8),
    # one stream of one token (T = B = 1, where slices of a GEMM output come back contiguous);
    # one query head on one KV head; rotary over the whole head
    Case(lengths=(1,), context=(3,), HQ=1, HKV=1, R=16),
    # head_dim 48 with rotary dim 12 (rotary / 2 = 6); three query heads on one KV head; blocks of 48
    Case(lengths=(5, 40), context=(50, 0), HD=48, R=12, HQ=3, HKV=1, BS=48),
    # dk != dv, neither a power of two, three value heads per key head; HQ == HKV; head_dim 24 with
    # rotary dim 2 (rotary / 2 = 1); conv width 2; blocks of 32
    Case(lengths=(70, 3), context=(0, 29), H=1, HV=3, K=24, V=40, HQ=2, HKV=2, HD=24, R=2, W=2, BS=32),
    # no tokens at all: every stream is zero-length padding
    Case(lengths=(0, 0), context=(0, 0)),
]


def _rand(*shape, dtype, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def meta(case: Case, g: torch.Generator):
    """cu_seqlens, slot_ids (padding streams on the scratch slot), context_lens, block_tables."""
    B = len(case.lengths)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(case.lengths).cumsum(0)
    real = torch.randperm(case.num_slots, generator=g)[:B]
    slots = torch.where(torch.tensor(case.lengths) > 0, real, torch.full_like(real, case.num_slots))
    mb = case.num_blocks // B
    blocks = torch.randperm(case.num_blocks, generator=g)[: mb * B].view(B, mb).to(torch.int32)
    ctx = torch.tensor(case.context, dtype=torch.int32)
    assert all((c + n) <= mb * case.BS for c, n in zip(case.context, case.lengths))
    return cu, slots, ctx, blocks


def op_args(name: str, case: Case, dtype: torch.dtype, seed: int = 0) -> tuple:
    """Positional arguments of metrale::<name> for one case."""
    g = torch.Generator().manual_seed(seed)
    T = sum(case.lengths)
    cu, slots, ctx, blocks = meta(case, g)
    C = 2 * case.H * case.K + case.HV * case.V
    D, I = case.D, case.I
    eps = 1e-6

    def w(*shape):
        return _rand(*shape, dtype=dtype, g=g, scale=shape[-1] ** -0.5)

    def norm_w(n):
        return _rand(n, dtype=dtype, g=g, scale=0.2)

    if name == "gdn_proj":
        return (_rand(T, D, dtype=dtype, g=g), norm_w(D), w(C, D), w(case.HV * case.V, D), w(case.HV, D),
                w(case.HV, D), torch.empty(case.HV).uniform_(1, 16, generator=g).log().to(dtype),
                _rand(case.HV, dtype=dtype, g=g), eps)
    if name == "causal_conv1d":
        return (_rand(T, C, dtype=dtype, g=g), w(C, case.W), cu, slots,
                _rand(case.num_slots + 1, C, case.W - 1, dtype=dtype, g=g))
    if name == "l2norm":
        return (_rand(T, 2 * case.H, case.K, dtype=dtype, g=g),)
    if name == "gdn_recurrence":
        qk = torch.nn.functional.normalize(torch.randn(T, 2 * case.H, case.K, generator=g), dim=-1).to(dtype)
        q, k = qk[:, : case.H], qk[:, case.H:]  # strided views, as the model passes them
        if T == 0:  # except when empty: opcheck's input clone sizes an empty strided view at < 0 elements
            q, k = q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)
        return (q, k, _rand(T, case.HV, case.V, dtype=dtype, g=g),
                -torch.rand(T, case.HV, generator=g) * 0.5, torch.rand(T, case.HV, generator=g).to(dtype),
                cu, slots, torch.randn(case.num_slots + 1, case.HV, case.K, case.V, generator=g) * 0.1)
    if name == "gdn_out":
        return (_rand(T, case.HV, case.V, dtype=dtype, g=g), _rand(T, case.HV * case.V, dtype=dtype, g=g),
                _rand(T, D, dtype=dtype, g=g), 1 + norm_w(case.V), w(D, case.HV * case.V), norm_w(D),
                w(I, D), w(I, D), w(D, I), eps)
    if name == "attn_proj":
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(case.context, case.lengths)])
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, case.R, 2).float() / case.R))
        return (_rand(T, D, dtype=dtype, g=g), norm_w(D), w(case.HQ * case.HD * 2, D), w(case.HKV * case.HD, D),
                w(case.HKV * case.HD, D), norm_w(case.HD), norm_w(case.HD), positions, inv_freq, case.HD, eps)
    if name == "paged_attention":
        kv = (case.num_blocks + 1, case.BS, case.HKV, case.HD)
        return (_rand(T, case.HQ, case.HD, dtype=dtype, g=g), _rand(T, case.HKV, case.HD, dtype=dtype, g=g),
                _rand(T, case.HKV, case.HD, dtype=dtype, g=g), _rand(*kv, dtype=dtype, g=g),
                _rand(*kv, dtype=dtype, g=g), cu, ctx, blocks)
    if name == "attn_out":
        return (_rand(T, case.HQ, case.HD, dtype=dtype, g=g), _rand(T, case.HQ * case.HD, dtype=dtype, g=g),
                _rand(T, D, dtype=dtype, g=g), w(D, case.HQ * case.HD), norm_w(D), w(I, D), w(I, D), w(D, I), eps)
    raise KeyError(name)
