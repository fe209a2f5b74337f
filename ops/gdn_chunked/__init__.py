"""Our chunked forward of the gated delta rule (Triton), a drop-in for fla_varlen's contract.

Per value head j (key head j // r, r = HV / H), token by token from the sequence's h0:
    S = exp(g_t) * S;  S = S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T (q_t * K**-0.5)
with S [K, V] fp32. Chunked (chunk C = 64 tokens, rows i, j of one chunk, S the state at its start,
G_i = exp(cumsum(g)_i) the decay from the chunk's start through token i):
    A_ij = beta_i (k_i . k_j) G_i / G_j (i > j),   T = (I + A)^-1 diag(beta)          (intra)
    Aqk_ij = scale (q_i . k_j) G_i / G_j (i >= j)                                      (intra)
    v_new = T (v - G * (k S))           the WY form of beta (v - pred), row by row    (state pass)
    o = scale * G * (q S) + Aqk v_new                                                   (state pass)
    S' = G_C * S + k^T ((G_C / G) * v_new)                                              (state pass)
(v_new = u - w S with fla's u = T_fla diag(beta) v and w = T_fla diag(beta G) k, associated the
other way: T (v - G (k S)) costs one [C, C] x [C, BV] dot where w = T k costs a [C, C] x [C, K] one,
and w, u need not exist at all.)

Two launches (fla 0.6.0 takes five: cumsum, kkt + solve, w / u, state pass writing every chunk's
state, output):
1. `_gdn_chunk_intra_kernel`, one program per (value head, chunk): the decay cumsum, k k^T and q k^T as whole
   [64, 64] tiles, and T by a solve that is stable where keys repeat (a power series of A cancels
   catastrophically there; see the kernel). Writes T (beta folded in), Aqk (scale folded in) in the
   input dtype and the cumsum in fp32: 16 KB a chunk and head (bf16, K = V = 128) where fla writes and
   reads back A, w, u, v_new and every chunk's state (88 KB).
2. `_gdn_chunk_state_kernel`, one program per (value head, V tile of BV columns, sequence): the chunks of its
   sequence in order, S [K, BV] fp32 in registers, the output of each chunk written as it goes (no
   per-chunk states in memory), the final state, and the optional checkpoints. V columns of S evolve
   independently, so a tile needs no other tile's data: smaller tiles are more programs for one long
   sequence (fla: 2 tiles x 32 heads = 64 programs on 132 SMs; BV = 16 gives 256) at the price of
   reading each chunk's k, q, T, Aqk once per tile (from L2: the tiles of one head, and the r value
   heads of one key head, are adjacent program ids).
Dots accumulate in fp32; operands are the input dtype (S rounded to it for the dots, as fla does); dots
of fp32 operands (the solve; all of them for fp32 inputs) take ChunkConfig.fp32_dots. Every grid follows
from shapes, no host sync, no data-dependent allocation: exact in CUDA graph replay. The kernels read
and write through strides and take each sequence's start and end separately, so any bounds work,
chunk-aligned or not, and a sequence may be empty wherever it lies.

Two entry points: `chunked_gdn_forward`, fla_varlen's contract (cu_aligned, h0 in, final states out),
and `chunked_gdn_pool_forward`, the GDN op's chunked path: the packed tokens as they are, each stream's
state read from and written back to its row of the state pool by slot index inside the state kernel,
empty sequences (streams left to the recurrent kernel, padding) reading and writing no state, and the
output rows of tokens in no stream zeroed by the spare sequence's programs.

Shape letters: T (T_al) token rows, H / HV key / value heads, K / V head dims, N sequences (B streams +
the absorber or spare sequence), NT chunks, P checkpoints, S pool slots, C = 64.

The package: kernels.py (the two Triton kernels), launch.py (ChunkConfig, the checks and the launches:
the two entry points), reference.py (the token-by-token fp32 reference).
"""

from .kernels import CHUNK
from .launch import (MAX_HEAD_DIM, ChunkConfig, chunked_gdn_forward, chunked_gdn_pool_forward, default_config,
                     supported_head_dims)
from .reference import chunked_gdn_reference

__all__ = ["CHUNK", "MAX_HEAD_DIM", "ChunkConfig", "chunked_gdn_forward", "chunked_gdn_pool_forward",
           "chunked_gdn_reference", "default_config", "supported_head_dims"]
