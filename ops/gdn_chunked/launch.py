"""The chunked gated delta rule's launches: ChunkConfig (the launch parameters) and default_config, the
argument checks, and the two entry points, `chunked_gdn_forward` (fla_varlen's contract) and
`chunked_gdn_pool_forward` (the GDN op's chunked path, on the state pool); the package docstring says what
each computes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .kernels import CHUNK, _gdn_chunk_intra_kernel, _gdn_chunk_state_kernel


@dataclass(frozen=True)
class ChunkConfig:
    """Launch parameters (results do not depend on them beyond rounding order).

    block_v: V columns of the state per state-pass program (a power of two, >= 16).
    state_warps / state_stages, intra_warps / intra_stages: num_warps / num_stages of the two kernels.
    solve_block: rows of the blocks the solve inverts by forward substitution (1..64, a power of two;
        solve_block - 2 sequential row steps) before its log2(64 / solve_block) doublings (two [64, 64]
        dots each); 16 is fla's split.
    fp32_dots: input_precision of the dots whose operands are fp32: the solve's, and every dot of fp32
        inputs ("ieee", "tf32x3" or "tf32"). Default: "tf32" for 16-bit inputs (fla's solve), "tf32x3"
        for fp32 inputs (fp32-exact to ~1e-6 on tensor cores; "ieee" takes minutes to compile).
    heads: value heads per state-pass program, 1 or 2 (2: the two value heads of one key head share the
        program's loads of k and q and its k S / q S / update dots, G * block_v columns wide; it must divide
        the value heads per key head). An experiment, not yet timed: benchmarks/kernels/check_gdn_chunked.py.
    """
    block_v: int = 32
    state_warps: int = 4
    state_stages: int = 2
    intra_warps: int = 4
    intra_stages: int = 2
    solve_block: int = 16
    fp32_dots: str | None = None
    heads: int = 1

    def __post_init__(self):
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"ChunkConfig.block_v must be a power of two >= 16, got {self.block_v}")
        if self.solve_block not in (1, 2, 4, 8, 16, 32, 64):
            raise ValueError(f"ChunkConfig.solve_block must be a power of two in 1..64, got {self.solve_block}")
        if self.fp32_dots not in (None, "ieee", "tf32x3", "tf32"):
            raise ValueError(f"ChunkConfig.fp32_dots must be None, 'ieee', 'tf32x3' or 'tf32', got {self.fp32_dots!r}")
        for name in ("state_warps", "intra_warps"):
            w = getattr(self, name)
            if w not in (1, 2, 4, 8, 16):
                raise ValueError(f"ChunkConfig.{name} must be 1, 2, 4, 8 or 16, got {w}")
        if self.heads not in (1, 2):
            raise ValueError(f"ChunkConfig.heads must be 1 or 2, got {self.heads}")
        for name in ("state_stages", "intra_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChunkConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def name(self) -> str:
        return (f"bv{self.block_v}-w{self.state_warps}s{self.state_stages}-iw{self.intra_warps}s{self.intra_stages}"
                f"-sb{self.solve_block}{'-' + self.fp32_dots if self.fp32_dots else ''}"
                f"{f'-g{self.heads}' if self.heads > 1 else ''}")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_config(num_seqs: int, HV: int, V: int, device: torch.device | None = None) -> ChunkConfig:
    """The widest V tile (32 down to 16) that still gives the state pass about two programs per SM over
    the real sequences (num_seqs - 1: the last is the absorber / spare sequence), 4 warps, 2 stages. Static
    sizes only. At the 9B heads on an H200 (HV 32, V 128: docs/ops.md, "How the GDN op keeps its
    chunked path static") that is BV 16 for one stream and BV 32 from 4 streams on, the fastest of the
    sweep at every measured shape; BV 64 lost at 8 and 32 streams."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device is not None and device.type == "cuda" else 132
    bv = min(32, max(16, triton.next_power_of_2(V)))
    while bv > 16 and max(num_seqs - 1, 1) * HV * triton.cdiv(V, bv) < 2 * sms:
        bv //= 2
    return ChunkConfig(block_v=bv, state_warps=4, state_stages=2)


# Launchers -----------------------------------------------------------------------------------------
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _fail(fn: str, msg: str):
    raise ValueError(f"{fn}: {msg}")


def _check_tokens(fn, q, k, v, g, beta, chunk_indices, checkpoint_chunks, checkpoints, more, checkpoint_entries=None):
    """The checks both entry points share; `more`: (name, tensor, ndim) of their other tensors."""
    for name, t, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2),
                        ("chunk_indices", chunk_indices, 2), *more):
        if t.dim() != nd:
            _fail(fn, f"{name} must be {nd}-D, got shape {tuple(t.shape)}")
        if t.device != q.device:
            _fail(fn, f"{name} is on {t.device}, q on {q.device}")
    T, H, K = q.shape
    HV, V = v.shape[1:]
    if tuple(k.shape) != (T, H, K) or k.dtype != q.dtype:
        _fail(fn, f"k is {tuple(k.shape)} {k.dtype}, expected {(T, H, K)} {q.dtype} like q")
    if v.shape[0] != T or v.dtype != q.dtype or HV % H:
        _fail(fn, f"v is {tuple(v.shape)} {v.dtype}; expected {T} rows, {q.dtype}, value heads a multiple of {H}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _fail(fn, f"q, k, v must be float32, bfloat16 or float16, got {q.dtype}")
    if tuple(g.shape) != (T, HV) or g.dtype != torch.float32:
        _fail(fn, f"g is {tuple(g.shape)} {g.dtype}, expected {(T, HV)} torch.float32")
    if tuple(beta.shape) != (T, HV) or beta.dtype not in (q.dtype, torch.float32):
        _fail(fn, f"beta is {tuple(beta.shape)} {beta.dtype}, expected {(T, HV)} {q.dtype} or torch.float32")
    if chunk_indices.dtype != torch.int64 or chunk_indices.shape[1:] != (2,):
        _fail(fn, f"chunk_indices must be int64 [NT, 2], got {chunk_indices.dtype} {tuple(chunk_indices.shape)}")
    if not supported_head_dims(K, V, q.device):
        _fail(fn, f"head dims K = {K}, V = {V}: supported 1..{MAX_HEAD_DIM} (on a GPU K a multiple of 16 or "
                  f"below 16)")
    if (checkpoint_chunks is None) != (checkpoints is None):
        _fail(fn, "checkpoint_chunks and checkpoints come together")
    if checkpoints is not None:
        P = checkpoint_chunks.shape[0] if checkpoint_chunks.dim() == 1 else -1
        if checkpoint_chunks.dtype != torch.int64 or P < 0 or checkpoint_chunks.device != q.device:
            _fail(fn, f"checkpoint_chunks must be int64 [P] on {q.device}, got {checkpoint_chunks.dtype} "
                      f"{tuple(checkpoint_chunks.shape)} on {checkpoint_chunks.device}")
        E = P if checkpoint_entries is None else checkpoints.shape[0]
        if (tuple(checkpoints.shape) != (E, HV, K, V) or checkpoints.dtype != torch.float32
                or checkpoints.device != q.device):
            _fail(fn, f"checkpoints is {tuple(checkpoints.shape)} {checkpoints.dtype} on {checkpoints.device}, "
                      f"expected {(E, HV, K, V)} torch.float32 on {q.device}")
        if checkpoint_entries is not None and (checkpoint_entries.dtype != torch.int64
                                               or tuple(checkpoint_entries.shape) != (P,)
                                               or checkpoint_entries.device != q.device):
            _fail(fn, f"checkpoint_entries must be int64 [{P}] on {q.device}, got {checkpoint_entries.dtype} "
                      f"{tuple(checkpoint_entries.shape)} on {checkpoint_entries.device}")
    elif checkpoint_entries is not None:
        _fail(fn, "checkpoint_entries needs checkpoint_chunks and checkpoints")


MAX_HEAD_DIM = 256  # K and V: a [K, BV] state tile and [64, K] key tiles in registers


def supported_head_dims(K: int, V: int, device: torch.device | str | None = None) -> bool:
    """Whether our kernels take key / value head dims K, V: up to MAX_HEAD_DIM; compiled for a GPU, K a
    multiple of 16 or below 16 as well (measured on the H200, triton 3.6: the state kernel's bf16 build
    made illegal accesses at K 24 and 200, padded to 32 / 256, and ran right at 8, 16, 128; the
    interpreter takes any K). The GDN op hands other dims to fla (gdn_recurrence.chunked_backend)."""
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        return False
    return torch.device(device).type != "cuda" if device is not None and K >= 16 and K % 16 else True


def _rows(x: Tensor) -> Tensor:
    """x with a unit last stride (the kernels index rows and heads by strides, columns densely)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(q, k, v, g, beta, bos, eos, chunk_indices, h0, ht, slots, o, checkpoint_chunks, checkpoints,
            config, pool: bool, checkpoint_entries=None) -> None:
    """Both kernels over len(bos) sequences (bos, eos [N] token bounds, any integer dtype); states read from
    h0[slot] and written to ht[slot] (slot = n, or slots[n] with `pool`), outputs into o [T, HV, V]."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    N, NT = bos.shape[0], chunk_indices.shape[0]
    cfg = config or default_config(N, HV, V, q.device)
    if (HV // H) % cfg.heads:
        raise ValueError(f"ChunkConfig.heads {cfg.heads} must divide the value heads per key head, {HV // H}")
    q, k, v, g, beta = (_rows(x) for x in (q, k, v, g, beta))
    chunk_indices = chunk_indices.contiguous()
    # The interpreter multiplies 16-bit tiles as their raw bits: upcast there (after the same roundings).
    prec = cfg.fp32_dots or ("tf32x3" if q.dtype == torch.float32 else "tf32")
    dot_t = tl.float32 if q.device.type != "cuda" else _TL_DTYPES[q.dtype]
    BK = max(16, triton.next_power_of_2(K))
    BV = min(cfg.block_v, max(16, triton.next_power_of_2(V)))
    scale = K ** -0.5

    rows = max(NT, 1)  # the state kernel takes the buffers as pointers, read only for chunks
    gc = torch.empty((HV, rows, CHUNK), dtype=torch.float32, device=q.device)
    tmat = torch.empty((HV, rows, CHUNK, CHUNK), dtype=q.dtype, device=q.device)
    aqk = torch.empty_like(tmat)
    first = torch.empty(N, dtype=torch.int64, device=q.device)  # read only for sequences with chunks
    if NT:
        _gdn_chunk_intra_kernel[(HV, NT)](
            q, k, g, beta, bos, eos, chunk_indices, gc, tmat, aqk, first, NT, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), R=HV // H, K=K, BK=BK, SB=cfg.solve_block,
            LOG_SB=cfg.solve_block.bit_length() - 1, PREC=prec, DOT_T=dot_t,
            num_warps=cfg.intra_warps, num_stages=cfg.intra_stages)
    P = 0 if checkpoints is None else checkpoint_chunks.shape[0]
    ck_idx = checkpoint_chunks.contiguous() if P else bos  # unread when P == 0 (non-empty stand-ins)
    if P:
        ck_dest = (torch.arange(P, dtype=torch.int64, device=q.device) if checkpoint_entries is None
                   else checkpoint_entries.contiguous())
    else:
        ck_dest = bos
    ck = checkpoints if P else ht
    ck_strides = ck.stride() if P else (0, 0, 0, 0)
    slots = slots if pool and slots.shape[0] else bos  # read only for non-empty sequences before the spare one
    _gdn_chunk_state_kernel[(HV // cfg.heads * triton.cdiv(V, BV), N)](
        q, k, v, gc, tmat, aqk, first, h0, ht, slots, o, bos, eos, ck_idx, ck_dest, ck, NT, T, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *h0.stride(), *ht.stride(),
        *ck_strides, R=HV // H, HV=HV, K=K, V=V, P=P, BK=BK, BV=BV, BLOCK_P=triton.next_power_of_2(max(P, 1)),
        PREC=prec, DOT_T=dot_t, POOL=pool, G=cfg.heads, num_warps=cfg.state_warps, num_stages=cfg.state_stages)


def chunked_gdn_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_aligned: Tensor,
                        chunk_indices: Tensor, h0: Tensor, checkpoint_chunks: Tensor | None = None,
                        checkpoints: Tensor | None = None, config: ChunkConfig | None = None
                        ) -> tuple[Tensor, Tensor]:
    """The gated delta rule over N varlen sequences, chunk by chunk (fla_varlen's contract).

    Args:
        q, k: [T_al, H, K] (fp32 / bf16 / fp16; q is scaled by K**-0.5 here), v: [T_al, HV, V] same dtype.
        g: [T_al, HV] fp32 log-decay; beta: [T_al, HV] in q's dtype or fp32.
        cu_aligned: [N+1] int64 sequence boundaries (any, not only chunk-aligned ones).
        chunk_indices: [NT, 2] int64, row c = (sequence, chunk within it): every sequence's chunks of 64
            tokens in order, sequence by sequence (fla's prepare_chunk_indices(cu_aligned, 64)); rows after
            them may name an empty sequence (computed on nothing, read by none: a fixed NT for any lengths).
        h0: [N, HV, K, V] fp32 initial states.
        checkpoint_chunks: optional [P] int64: a chunk row c, or -1 (or any value outside 0..NT-1) for none.
        checkpoints: [P, HV, K, V] fp32, with checkpoint_chunks. MUTATED: entry p receives the state at the
            start of chunk checkpoint_chunks[p] (its sequence's state after the tokens before that chunk);
            entries whose chunk is none are left as they were.
        config: launch parameters (default: default_config).
    Returns:
        o: [T_al, HV, V] in v's dtype (rows outside every sequence unspecified),
        final: [N, HV, K, V] fp32, each sequence's state after its last token (h0 for an empty one).
    """
    fn = "chunked_gdn_forward"
    _check_tokens(fn, q, k, v, g, beta, chunk_indices, checkpoint_chunks, checkpoints,
                  (("cu_aligned", cu_aligned, 1), ("h0", h0, 4)))
    if cu_aligned.dtype != torch.int64 or cu_aligned.shape[0] < 2:
        _fail(fn, f"cu_aligned must be int64 with >= 2 entries, got {cu_aligned.dtype} {tuple(cu_aligned.shape)}")
    N, HV, K, V = cu_aligned.shape[0] - 1, v.shape[1], q.shape[2], v.shape[2]
    if tuple(h0.shape) != (N, HV, K, V) or h0.dtype != torch.float32:
        _fail(fn, f"h0 is {tuple(h0.shape)} {h0.dtype}, expected {(N, HV, K, V)} torch.float32")
    cu_aligned, h0 = cu_aligned.contiguous(), h0.contiguous()
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    final = torch.empty((N, HV, K, V), dtype=torch.float32, device=q.device)
    _launch(q, k, v, g, beta, cu_aligned[:-1], cu_aligned[1:], chunk_indices, h0, final, None, o,
            checkpoint_chunks, checkpoints, config, pool=False)
    return o, final


def chunked_gdn_pool_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, bounds: Tensor,
                             chunk_indices: Tensor, state: Tensor, slots: Tensor, o: Tensor | None = None,
                             checkpoint_chunks: Tensor | None = None, checkpoints: Tensor | None = None,
                             config: ChunkConfig | None = None, checkpoint_entries: Tensor | None = None) -> Tensor:
    """The gated delta rule over B packed streams, each from and back into its row of a state pool (the GDN
    op's chunked path: no layout copies, no state gather / scatter).

    Args:
        q, k, v, g, beta: as chunked_gdn_forward, over T packed tokens (T rows, in stream order or not).
        bounds: [2, B+1] int64: sequence n < B is the token rows [bounds[0, n], bounds[1, n]) (any bounds,
            unaligned, empty ones for streams left to another kernel); sequence B, the spare one, is empty
            (bounds[0, B] == bounds[1, B] = the first row of the tokens in no stream, say cu_seqlens[B]).
        chunk_indices: [NT, 2] int64 as chunked_gdn_forward's: every stream's chunks in order (stream b's
            chunk i at row first_b + i), then rows naming the spare sequence B (any chunk within it).
        state: [S, HV, K, V] fp32 pool, any strides. MUTATED: row slots[n] of every non-empty sequence n
            receives its final state (read from that row first); the rows of empty sequences' slots, and
            of slots outside the batch, are neither read nor written.
        slots: [B] int32 / int64 slot of each stream (distinct among non-empty ones).
        o: optional [T, HV, V] contiguous output in v's dtype (default: a new one).
            MUTATED: rows of the sequences' tokens get their outputs, rows [bounds[0, B], T) get 0, the
            other rows (tokens of empty sequences) are left as they are.
        checkpoint_chunks, checkpoints: as chunked_gdn_forward's (chunk rows of chunk_indices; an entry whose
            row names the spare sequence is left as it was, like one of no chunk).
        checkpoint_entries: optional [P] int64 (with checkpoint_chunks): checkpoint p goes to
            checkpoints[checkpoint_entries[p]] instead of checkpoints[p] (checkpoints then [E, HV, K, V], any
            E, entries in 0..E-1 and distinct among those with a chunk: a pool of prefix-caching states).
        config: launch parameters (default: default_config(B + 1, HV, V)).
    Returns:
        o.
    """
    fn = "chunked_gdn_pool_forward"
    _check_tokens(fn, q, k, v, g, beta, chunk_indices, checkpoint_chunks, checkpoints,
                  (("bounds", bounds, 2), ("state", state, 4), ("slots", slots, 1)), checkpoint_entries)
    B = slots.shape[0]
    T, HV, K, V = q.shape[0], v.shape[1], q.shape[2], v.shape[2]
    if bounds.dtype != torch.int64 or tuple(bounds.shape) != (2, B + 1):
        _fail(fn, f"bounds must be int64 [2, {B + 1}] for {B} slots, got {bounds.dtype} {tuple(bounds.shape)}")
    if slots.dtype not in (torch.int32, torch.int64):
        _fail(fn, f"slots must be int32 or int64, got {slots.dtype}")
    if tuple(state.shape[1:]) != (HV, K, V) or state.dtype != torch.float32:
        _fail(fn, f"state is {tuple(state.shape)} {state.dtype}, expected [S, {HV}, {K}, {V}] torch.float32")
    if o is None:
        o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    elif tuple(o.shape) != tuple(v.shape) or o.dtype != v.dtype or o.device != v.device or not o.is_contiguous():
        _fail(fn, f"o is {tuple(o.shape)} {o.dtype} on {o.device} (contiguous: {o.is_contiguous()}), expected a "
                  f"contiguous {tuple(v.shape)} {v.dtype} on {v.device}")
    if T == 0:
        return o
    bounds, slots = bounds.contiguous(), slots.contiguous()
    _launch(q, k, v, g, beta, bounds[0], bounds[1], chunk_indices, state, state, slots, o, checkpoint_chunks,
            checkpoints, config, pool=True, checkpoint_entries=checkpoint_entries)
    return o
