"""The transformers oracle: reference models of a config with random weights, their logits, and the
parity check of our prefill against them."""

from __future__ import annotations

import torch

from metrale_graph.config import ModelConfig
from metrics import rel_err


def hf_class(cfg: ModelConfig):
    """transformers' causal-LM class of the config's family."""
    import transformers

    return getattr(transformers, cfg.family.causal_lm_class)


def randomize_reference(model, seed: int):
    """Overwrite, in place, every parameter of a transformers model from its own `seed`; returns it in fp32,
    in eval mode. Matrices: randn * in_features**-0.5 (unit gain, as helpers.unit_gain); A_log: log of
    uniform [1, 16) (as random_weights); other vectors: their init plus 0.2 randn (norm weights too, so the
    zero-centred (1 + w) convention is exercised). The oracle draws its own weights, on transformers' names,
    rather than loading ours (metrale_graph.weights.random_weights through our saver): the parity tests then
    check our loader against checkpoints transformers wrote, not our saver against itself."""
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


def hf_reference(cfg: ModelConfig, seed: int = 0, multimodal: bool = False):
    """A transformers model of `cfg` (Qwen3.5, Qwen3.5-MoE or Qwen3-Next, by cfg.model_type) in fp32
    with every weight random (randomize_reference). MoE experts run transformers' eager per-expert loop."""
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
    return randomize_reference(model, seed)


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
