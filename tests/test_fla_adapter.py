"""The flash-linear-attention adapter of the GDN recurrence's chunked path (fla itself runs in the GPU
tests): the installed forward's signature and return value are checked against what the adapter
passes and reads, and a mismatch names fla's version and what differs."""

import pytest
import torch

from metrale_graph.ops.gdn_recurrence import fla_adapter


def fla_0_6_0_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False, cu_seqlens=None,
                  cp_context=None, chunk_indices=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                  chunk_size=64):
    """The signature of fla 0.6.0's chunk_gated_delta_rule_fwd (fla/ops/gated_delta_rule/chunk.py), returning
    its six values (g, o, A, final_state, initial_state, g_input) for inputs of a batch of one."""
    o = torch.full_like(v, 2.0)
    return g, o, None, initial_state + 1, initial_state, None


def test_the_signature_of_fla_0_6_0_passes():
    fla_adapter.check_signature(fla_0_6_0_fwd, "0.6.0")
    fla_adapter.check_signature(lambda **kwargs: None, "9.9")  # takes any keyword


def test_a_renamed_or_new_required_argument_names_the_version():
    def renamed(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None, chunk_offsets=None):
        pass

    def new_required(q, k, v, g, beta, scale, initial_state, output_final_state, layout, cu_seqlens=None,
                     chunk_indices=None):
        pass

    def positional_only(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices, /):
        pass

    with pytest.raises(RuntimeError, match=r"flash-linear-attention 0\.7\.0: .* does not take chunk_indices by keyword"
                                           r".*written for flash-linear-attention==0\.6\.0"):
        fla_adapter.check_signature(renamed, "0.7.0")
    with pytest.raises(RuntimeError, match=r"flash-linear-attention 0\.8\.0: .* requires layout, which the GDN op "
                                           r"does not pass"):
        fla_adapter.check_signature(new_required, "0.8.0")
    with pytest.raises(RuntimeError, match=r"does not take q, k, v, g, beta, scale, initial_state, "
                                           r"output_final_state, cu_seqlens, chunk_indices by keyword"):
        fla_adapter.check_signature(positional_only, "0.9.0")


def _layout(T_al=128, H=1, HV=2, K=8, V=4, N=3):
    q = torch.randn(T_al, H, K)
    return (q, q.clone(), torch.randn(T_al, HV, V), torch.zeros(T_al, HV), torch.zeros(T_al, HV),
            torch.tensor([0, 64, 64, 128]), torch.tensor([[0, 0], [2, 0]]), torch.randn(N, HV, K, V))


def test_fla_varlen_reads_o_and_final_state_by_their_places(monkeypatch):
    monkeypatch.setattr(fla_adapter, "_fwd", fla_0_6_0_fwd)
    monkeypatch.setattr(fla_adapter, "_returns_checked", False)
    monkeypatch.setattr(fla_adapter, "_version", lambda: "0.6.0")
    args = _layout()
    o, final = fla_adapter.fla_varlen(*args)
    assert torch.equal(o, torch.full_like(args[2], 2.0)) and torch.equal(final, args[-1] + 1)
    assert fla_adapter._returns_checked


@pytest.mark.parametrize("returns", ["five values", "o and final_state swapped"])
def test_another_return_value_names_the_version(monkeypatch, returns):
    def fwd(**kwargs):
        g, o, A, final, initial, g_input = fla_0_6_0_fwd(**kwargs)
        return (g, o, A, final, initial) if returns == "five values" else (g, final, A, o, initial, g_input)

    monkeypatch.setattr(fla_adapter, "_fwd", fwd)
    monkeypatch.setattr(fla_adapter, "_returns_checked", False)
    monkeypatch.setattr(fla_adapter, "_version", lambda: "0.7.1")
    with pytest.raises(RuntimeError, match=r"flash-linear-attention 0\.7\.1: .* returned \d values .*expected 6 "
                                           r"\(g, o, A, final_state, initial_state, g_input\) with o \(1, 128, 2, 4\) "
                                           r"and final_state \(3, 2, 8, 4\)"):
        fla_adapter.fla_varlen(*_layout())
