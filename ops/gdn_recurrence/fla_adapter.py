"""flash-linear-attention's chunked gated delta rule, the GDN recurrence's chunked path with the "fla"
backend (the A/B baseline and second opinion beside our kernels): fla's forward called below its
autograd wrapper (which is compile-disabled and prepares chunk indices on the host), on the
chunk-aligned layout (layout.py), with fla's tensor cache off. Why: docs/ops.md, "How the GDN op
keeps its chunked path static".

`chunk_gated_delta_rule_fwd` is fla's internal forward, not its public API; this adapter is written
for flash-linear-attention 0.6.0 (the `cuda` extra pins it). At first use it checks that the
installed forward takes the keyword arguments we pass (FWD_ARGUMENTS) and requires no other, and
that it returns the 0.6.0 tuple (FWD_RETURNS); a mismatch raises a RuntimeError naming the installed
version and what differs.
"""

import inspect
import os

WRITTEN_FOR = "0.6.0"
FWD_NAME = "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_fwd"
# the arguments we pass, all by keyword
FWD_ARGUMENTS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
                 "chunk_indices")
# its return value, in order (fla 0.6.0, fla/ops/gated_delta_rule/chunk.py: `return g, o, A, final_state,
# initial_state, g_input`): the chunk-local cumulative gates, the output o [1, T, HV, V], the WY intra-chunk
# matrix A, the final states [N, HV, K, V] (N sequences), the initial states as used (compressed under
# context parallelism), and the raw gates when fla computes the gates in its kernel (else None).
# We read o and final_state.
FWD_RETURNS = ("g", "o", "A", "final_state", "initial_state", "g_input")
O_AT, FINAL_AT = FWD_RETURNS.index("o"), FWD_RETURNS.index("final_state")

_fwd = None  # the forward, once imported and its signature checked
_returns_checked = False


def check_signature(fwd, version: str) -> None:
    """RuntimeError, naming fla's `version`, unless `fwd` takes every one of FWD_ARGUMENTS by keyword and
    requires no other argument."""
    signature = inspect.signature(fwd)
    params = signature.parameters
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [n for n in FWD_ARGUMENTS
               if not (n in params and params[n].kind in (params[n].POSITIONAL_OR_KEYWORD, params[n].KEYWORD_ONLY))
               and not (any_keyword and n not in params)]
    required = [n for n, p in params.items() if n not in FWD_ARGUMENTS and p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    problems = ([f"does not take {', '.join(missing)} by keyword"] if missing else []) + (
        [f"requires {', '.join(required)}, which the GDN op does not pass"] if required else [])
    if problems:
        raise RuntimeError(f"flash-linear-attention {version}: {FWD_NAME}{signature} {' and '.join(problems)}; "
                           f"the GDN op's chunked path is written for flash-linear-attention=={WRITTEN_FOR}")


def check_returns(result, o_shape: tuple, state_shape: tuple, version: str) -> None:
    """RuntimeError, naming fla's `version`, unless the forward's return value is a tuple of
    len(FWD_RETURNS) whose o and final_state (at their places in FWD_RETURNS) have the shapes `o_shape`
    and `state_shape`."""
    values = result if isinstance(result, tuple) else (result,)
    fits = (isinstance(result, tuple) and len(result) == len(FWD_RETURNS)
            and tuple(getattr(result[O_AT], "shape", ())) == tuple(o_shape)
            and tuple(getattr(result[FINAL_AT], "shape", ())) == tuple(state_shape))
    if not fits:
        got = ", ".join(str(tuple(x.shape)) if hasattr(x, "shape") else type(x).__name__ for x in values)
        raise RuntimeError(
            f"flash-linear-attention {version}: {FWD_NAME} returned {len(values)} values ({got}); expected "
            f"{len(FWD_RETURNS)} ({', '.join(FWD_RETURNS)}) with o {tuple(o_shape)} and final_state "
            f"{tuple(state_shape)}, as flash-linear-attention=={WRITTEN_FOR} returns")


def _version() -> str:
    import fla
    return getattr(fla, "__version__", "(version unknown)")


def load_forward():
    """fla's forward, imported with its tensor cache off; its signature checked the first time."""
    global _fwd
    if _fwd is None:
        os.environ.setdefault("FLA_DISABLE_TENSOR_CACHE", "1")
        import fla.utils
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

        # fla reads this module attribute on every call, so this holds even if fla was imported first
        fla.utils.FLA_DISABLE_TENSOR_CACHE = True
        check_signature(chunk_gated_delta_rule_fwd, _version())
        _fwd = chunk_gated_delta_rule_fwd
    return _fwd


def fla_varlen(q, k, v, g, beta, cu_aligned, chunk_indices, h0):
    """The gated delta rule over the aligned sequences (the `varlen_fn` of layout.gdn_recurrence_aligned):
    q, k [T_al, H, K] (q unscaled), v [T_al, HV, V], g, beta [T_al, HV], cu_aligned [N+1], chunk_indices
    [NT, 2], h0 [N, HV, K, V] -> (o [T_al, HV, V], final [N, HV, K, V])."""
    global _returns_checked
    result = load_forward()(
        q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=q.shape[-1] ** -0.5,
        initial_state=h0, output_final_state=True, cu_seqlens=cu_aligned, chunk_indices=chunk_indices)
    if not _returns_checked:
        check_returns(result, (1, *v.shape), tuple(h0.shape), _version())
        _returns_checked = True
    return result[O_AT][0], result[FINAL_AT]
