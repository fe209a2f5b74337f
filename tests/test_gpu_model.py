"""On a GPU: the whole bf16 model on the qwen3.5-9b shape (a few layers) against transformers in
fp32 on the upcast weights."""

import pytest
import torch

from metrics import rel_err
from metrale_graph import PRESETS, HybridModel, Stream

pytestmark = pytest.mark.gpu


def test_bf16_model_matches_transformers_fp32():
    import transformers

    cfg = PRESETS["qwen3.5-9b"].replace(num_hidden_layers=4)  # 3 GDN + 1 attention layer
    model = HybridModel.from_preset(cfg, dtype=torch.bfloat16, device="cuda", seed=7)
    with torch.device("cuda"):
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg.to_hf()))
    state = {(n if n == "lm_head.weight" else "model." + n): p.float() for n, p in model.named_parameters()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    hf = hf.float().eval()
    hf_bf16 = transformers.Qwen3_5ForCausalLM(hf.config).to("cuda", torch.bfloat16).eval()
    hf_bf16.load_state_dict(hf.state_dict())

    g = torch.Generator().manual_seed(7)
    lengths = [1, 63, 64, 65, 1000]
    tokens = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    extra = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (17, 300)]
    cache = model.new_cache(num_slots=8, num_blocks=128)
    out = model.prefill(cache, [Stream(7 - i, t) for i, t in enumerate(tokens)]).float()
    cont = model.prefill(cache, [Stream(7, extra[0]), Stream(3, extra[1])]).float()
    cases = [(f"stream {i} ({len(t)} tokens)", out[i], t) for i, t in enumerate(tokens)]
    cases += [(f"continued stream {i}", cont[j], tokens[i] + t)
              for j, (i, t) in enumerate([(0, extra[0]), (4, extra[1])])]
    errors = []
    with torch.no_grad():
        for name, got, ids in cases:
            ids = torch.tensor([ids], device="cuda")
            ref = hf(input_ids=ids).logits[0, -1].float()
            baseline = hf_bf16(input_ids=ids).logits[0, -1].float()
            errors.append((name, rel_err(got, ref), rel_err(baseline, ref)))
            print(f"{name}: ours bf16 {errors[-1][1]:.2e}, transformers bf16 {errors[-1][2]:.2e} (vs fp32)")
    # A flat 2e-2 will not do (docs/testing.md: bf16 no further from fp32 than transformers' own bf16).
    # Measured on an H200 (seed 7, 4 layers of the 9B shape) transformers' own bf16 forward lands
    # 1.9e-2 to 3.3e-2 from its fp32 one, so bf16 rounding alone exceeds 2e-2 here; the check is that
    # ours is no further from fp32 than transformers' bf16 (10% slack) and within 3.5e-2.
    for name, ours, theirs in errors:
        assert ours <= max(2e-2, 1.1 * theirs) and ours <= 3.5e-2, (name, ours, theirs)
