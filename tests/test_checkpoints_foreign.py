"""Checkpoints written by other tools, on the CPU. transformers' own config classes (built from their keyword
arguments, not from ModelConfig.to_hf) and save_pretrained, for every family and multimodal wrapper: single
file and sharded, fp32 / bf16 / fp16, tied and untied (the pair stored under either name), with what
transformers' and Qwen's files carry beyond what a text prefill reads (architectures, torch_dtype in place of
dtype, transformers_version, the mrope rope_parameters, attn_output_gate and mtp_* fields, a vision tower), loaded
and run against transformers on the same folder (fp32, relative error <= 1e-4), and so are unusual configs
transformers' classes build (UNUSUAL); a whole MTP head in Qwen's layout
(mtp_head, declared in config.json or not) loads as the model's own. FP8: a checkpoint written by transformers'
FineGrainedFP8 quantizer, and ones in Qwen's published
layout written here (bf16 scales, the quantization_config at the top or in text_config, Qwen's explicit
modules_to_not_convert, per-expert and stacked experts, an FP8 MTP head), against transformers on the
dequantized weights (weight-only within metrics.fp32_model_bound: fp32's reordering of sums). Other quantization
methods, and folders no loader should take
(pickle-only weights, shards without their index, FP8 tensors without a quantization_config, no
config.json), are each a ValueError naming the method or the files."""

import contextlib
import glob
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import read_checkpoint, write_sharded
from metrics import fp32_model_bound, rel_err
from references import check_parity, hf_logits, random_streams, randomize_reference
from metrale_graph import HybridModel, Stream
from metrale_graph.ops.fp8 import activation_rounding

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# transformers' class names per family: text config, causal LM, multimodal config, multimodal model
CLASSES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeConfig",
                         "Qwen3_5MoeForConditionalGeneration"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", None, None),
}
TEXT = dict(vocab_size=256, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=24, max_position_embeddings=2048)
MOE = dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=20, shared_expert_intermediate_size=12)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2)
LENGTHS = [1, 20, 65]


def transformers_model(family: str, multimodal: bool, tie: bool = False, seed: int = 0, **text):
    """transformers' model of a tiny config of `family` (its multimodal wrapper with a one-block vision tower
    when `multimodal`), every weight random (references.randomize_reference), fp32."""
    import transformers

    text_cls, lm_cls, mm_cls, mm_model_cls = CLASSES[family]
    kwargs = {**TEXT, **({} if family == "qwen3_5_text" else MOE), **text}
    if family == "qwen3_5_moe_text":
        kwargs.pop("intermediate_size")  # no dense MLP
    if multimodal:
        config = getattr(transformers, mm_cls)(text_config=kwargs, tie_word_embeddings=tie,
                                               vision_config={**VISION, "out_hidden_size": kwargs["hidden_size"]})
        model = getattr(transformers, mm_model_cls)(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, text_cls)(**kwargs, tie_word_embeddings=tie))
    if family != "qwen3_5_text":
        model.set_experts_implementation("eager")
    return randomize_reference(model, seed)


def load_transformers(folder: str, multimodal: bool, fp8: bool = False):
    """transformers' fp32 model of a checkpoint folder (experts in its eager loop); an `fp8` one dequantized
    (as transformers does by itself without a GPU; with one it would keep FP8 modules whose kernels need it)."""
    import transformers

    cls = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
    quant = {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)} if fp8 else {}
    return cls.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager", **quant).eval()


def edit_config(folder, edit) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config)
    with open(path, "w") as f:
        json.dump(config, f)


def add_tensors(folder, tensors: dict[str, torch.Tensor]) -> None:
    """Add tensors to a checkpoint: into its one file, or as a new shard listed in its index."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        save_file(tensors, os.path.join(folder, "model-extra.safetensors"), metadata={"format": "pt"})
        with open(index) as f:
            data = json.load(f)
        data["weight_map"].update(dict.fromkeys(tensors, "model-extra.safetensors"))
        with open(index, "w") as f:
            json.dump(data, f)
    else:
        path = os.path.join(folder, "model.safetensors")
        save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})


def mtp_head(family: str, dtype=torch.bfloat16, seed: int = 5, **sizes) -> dict[str, torch.Tensor]:
    """A whole multi-token-prediction head (`mtp.`) as Qwen's checkpoints carry it, named and shaped from the
    format (written here, not by our saver): the fc and its two norms, one full-attention decoder layer of the
    family's kind (a dense MLP for Qwen3.5, per-expert tensors, a router, a shared expert and its gate for the
    MoE families), the final norm. `sizes` override TEXT / MOE's. transformers does not read it."""
    z = {**TEXT, **({} if family == "qwen3_5_text" else MOE), **sizes}
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return (torch.randn(*shape, generator=g) / (shape[-1] ** 0.5 if len(shape) > 1 else 5)).to(dtype)

    D, HD, HQ, HKV = z["hidden_size"], z["head_dim"], z["num_attention_heads"], z["num_key_value_heads"]
    layer = "mtp.layers.0."
    out = {"mtp.fc.weight": draw(D, 2 * D), "mtp.norm.weight": draw(D), "mtp.pre_fc_norm_embedding.weight": draw(D),
           "mtp.pre_fc_norm_hidden.weight": draw(D), layer + "input_layernorm.weight": draw(D),
           layer + "post_attention_layernorm.weight": draw(D),
           layer + "self_attn.q_proj.weight": draw(2 * HQ * HD, D), layer + "self_attn.k_proj.weight": draw(HKV * HD, D),
           layer + "self_attn.v_proj.weight": draw(HKV * HD, D), layer + "self_attn.o_proj.weight": draw(D, HQ * HD),
           layer + "self_attn.q_norm.weight": draw(HD), layer + "self_attn.k_norm.weight": draw(HD)}
    if family == "qwen3_5_text":
        inter = z["intermediate_size"]
        out.update({layer + "mlp.gate_proj.weight": draw(inter, D), layer + "mlp.up_proj.weight": draw(inter, D),
                    layer + "mlp.down_proj.weight": draw(D, inter)})
        return out
    E, IE, IS = z["num_experts"], z["moe_intermediate_size"], z["shared_expert_intermediate_size"]
    out.update({layer + "mlp.gate.weight": draw(E, D), layer + "mlp.shared_expert_gate.weight": draw(1, D),
                layer + "mlp.shared_expert.gate_proj.weight": draw(IS, D),
                layer + "mlp.shared_expert.up_proj.weight": draw(IS, D),
                layer + "mlp.shared_expert.down_proj.weight": draw(D, IS)})
    for e in range(E):
        out.update({f"{layer}mlp.experts.{e}.gate_proj.weight": draw(IE, D),
                    f"{layer}mlp.experts.{e}.up_proj.weight": draw(IE, D),
                    f"{layer}mlp.experts.{e}.down_proj.weight": draw(D, IE)})
    return out


def qwen_fields(multimodal: bool, family: str):
    """What Qwen's config.json files hold beyond transformers' fields: the mrope rope_parameters, the MTP and
    gate fields, and torch_dtype (transformers 4.x's name) in place of dtype."""
    def edit(config):
        text = config["text_config"] if multimodal else config
        text.update(attn_output_gate=True, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
                    mamba_ssm_dtype="float32", full_attention_interval=4, eos_token_id=5,
                    rope_parameters={"mrope_interleaved": True, "mrope_section": [2, 1, 1], "rope_type": "default",
                                     "rope_theta": 10_000_000, "partial_rotary_factor": 0.5})
        if family == "qwen3_5_moe_text":
            text["mlp_only_layers"] = []  # Qwen3.5-MoE's files carry it; transformers ignores it there
        for section in (config, text):
            if "dtype" in section:
                section["torch_dtype"] = section.pop("dtype")
        assert "transformers_version" in config and "architectures" in config
    return edit


def legacy_rope(multimodal: bool):
    """transformers 4.x's RoPE fields: rope_theta and partial_rotary_factor at the top, rope_scaling null."""
    def edit(config):
        text = config["text_config"] if multimodal else config
        text.pop("rope_parameters", None)
        text.update(rope_scaling=None, rope_theta=1e6, partial_rotary_factor=0.5)
    return edit


WRAPPED = [(f, False) for f in CLASSES] + [(f, True) for f, c in CLASSES.items() if c[2]]
CASES = [pytest.param(f, mm, dtype, shard, tie, extras,
                      id=f"{'mm-' if mm else ''}{f}-{str(dtype)[6:]}-{'sharded' if shard else 'single'}"
                         f"-{'tied' if tie else 'untied'}-{extras}")
         for f, mm in WRAPPED
         for dtype, shard, tie, extras in ((torch.float32, True, False, "qwen"), (torch.bfloat16, False, True, "mtp"),
                                           (torch.float16, False, False, "legacy-rope"))]


@pytest.mark.parametrize("family, multimodal, dtype, sharded, tie, extras", CASES)
def test_transformers_checkpoints_load_and_match(tmp_path, family, multimodal, dtype, sharded, tie, extras):
    folder = str(tmp_path)
    model = transformers_model(family, multimodal, tie, partial_rotary_factor=0.5).to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": "60KB"} if sharded else {}))
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json")) == sharded
    head = mtp_head(family, partial_rotary_factor=0.5) if extras in ("qwen", "mtp") else {}
    if head:
        add_tensors(folder, head)
    if extras == "qwen":
        edit_config(folder, qwen_fields(multimodal, family))
    elif extras == "legacy-rope":
        edit_config(folder, legacy_rope(multimodal))
    ours = HybridModel.from_pretrained(folder, progress=False)
    assert ours.config.model_type == family and ours.config.tie_word_embeddings == tie
    assert_mtp_head(ours, head)
    check_parity(ours, load_transformers(folder, multimodal), ours.config, LENGTHS)


UNUSUAL = [  # (family, multimodal, transformers' text config kwargs, whether config.json keeps layer_types)
    pytest.param("qwen3_5_text", False, dict(num_attention_heads=3, num_key_value_heads=1, head_dim=24), True,
                 id="mqa-3-heads-hd24"),
    pytest.param("qwen3_5_text", False, dict(layer_types=["linear_attention"] * 4), True, id="all-linear"),
    pytest.param("qwen3_5_text", False, dict(num_hidden_layers=5, full_attention_interval=3), False, id="interval-3"),
    pytest.param("qwen3_5_text", False, dict(num_hidden_layers=1, layer_types=["full_attention"]), True,
                 id="one-attention-layer"),
    pytest.param("qwen3_5_text", False, dict(vocab_size=257, hidden_size=50, intermediate_size=37,
                                             linear_conv_kernel_dim=2), True, id="odd-sizes-conv2"),
    pytest.param("qwen3_5_moe_text", True, dict(full_attention_interval=2, linear_num_key_heads=3,
                                                linear_num_value_heads=6), False, id="mm-interval-2-gdn-k3-v6"),
    pytest.param("qwen3_next", False, dict(layer_types=["full_attention"] * 4, num_experts_per_tok=5,
                                           linear_conv_kernel_dim=7, norm_topk_prob=False), True,
                 id="next-all-attention-topk-all-conv7"),
    pytest.param("qwen3_next", False, dict(num_key_value_heads=1, partial_rotary_factor=1.0, num_experts_per_tok=1,
                                           moe_intermediate_size=13, shared_expert_intermediate_size=7), True,
                 id="next-mqa-full-rotary-top1"),
]


@pytest.mark.parametrize("family, multimodal, text, layer_types", UNUSUAL)
def test_unusual_configs_transformers_accepts_match_it(tmp_path, family, multimodal, text, layer_types):
    """Configs built by transformers' own config classes that no other parity test holds: one key-value head, no
    attention layer at all (transformers' cache then cannot count positions: its reference runs use_cache=False), one
    layer, full_attention_interval other than 4 read from config.json where layer_types is absent, odd vocabulary,
    hidden and MLP sizes, GDN conv kernels 2 and 7, every expert routed or one, a full rotary dim."""
    folder = str(tmp_path)
    model = transformers_model(family, multimodal, **text)
    model.save_pretrained(folder)
    if not layer_types:  # as hand-written configs give it: the interval alone (transformers writes layer_types)
        def interval(config):
            section = config["text_config"] if multimodal else config
            del section["layer_types"]
            section["full_attention_interval"] = text["full_attention_interval"]
        edit_config(folder, interval)
    ours = HybridModel.from_pretrained(folder, progress=False)
    assert list(ours.config.layer_types) == list((model.config.text_config if multimodal else model.config).layer_types)
    model.config.use_cache = False
    check_parity(ours, model, ours.config, LENGTHS)



LIN, ATT = "linear_attention", "full_attention"
THROUGH_ENGINE = [  # (family, multimodal, tied, transformers' text config kwargs, Engine sizes)
    pytest.param("qwen3_5_text", False, False, dict(head_dim=80, partial_rotary_factor=0.5, linear_num_key_heads=1,
                                                    linear_num_value_heads=3, linear_key_head_dim=64,
                                                    linear_value_head_dim=96, linear_conv_kernel_dim=3),
                 dict(num_slots=1, token_budget=1, block_size=1), id="hd80-k64-v96-3v-per-k-conv3-one-slot-budget1"),
    pytest.param("qwen3_5_text", False, True, dict(head_dim=96, num_key_value_heads=1, vocab_size=1001,
                                                   layer_types=[ATT, LIN, LIN, LIN]),
                 dict(num_slots=2, token_budget=5, block_size=3, max_context=41), id="hd96-mqa-tied-1001-full-first"),
    pytest.param("qwen3_5_moe_text", True, False, dict(layer_types=[LIN, LIN, LIN, ATT], num_experts_per_tok=5,
                                                       rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e6,
                                                                            original_max_position_embeddings=64,
                                                                            partial_rotary_factor=0.5,
                                                                            mrope_section=[2, 1, 1],
                                                                            mrope_interleaved=True)),
                 dict(num_slots=3, block_size=64, prefix_cache=True), id="mm-full-last-topk-all-yarn-mrope"),
    pytest.param("qwen3_next", False, False, dict(num_hidden_layers=5, layer_types=[LIN, LIN, ATT, LIN, LIN],
                                                  decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False,
                                                  num_experts_per_tok=1, linear_conv_kernel_dim=2),
                 dict(num_slots=2, token_budget=2, block_size=3, overlap=False), id="next-one-attention-sparse-step2-top1"),
]


@pytest.mark.parametrize("family, multimodal, tie, text, sizes", THROUGH_ENGINE)
def test_unusual_configs_through_the_engine_match_transformers(tmp_path, family, multimodal, tie, text, sizes):
    """Unusual configs of transformers' classes (head dims 80 and 96, GDN key and value head dims apart with three value
    heads per key head, conv kernels 2 and 3, attention only first, last or in one layer, one KV head, a tied odd
    vocabulary, every expert or one routed, unnormalized top-k, decoder_sparse_step with mlp_only_layers, yarn under
    mrope sections) through an Engine of unusual sizes (one slot with a budget of one token, blocks of 1, 3 and 64,
    a max_context one token past the longest prompt, prefix caching, no overlap): each request's greedy tokens, its
    prompt's and its tokens' logprobs are transformers' own on the prompt and the tokens together."""
    from metrale_graph import Engine

    folder = str(tmp_path)
    model = transformers_model(family, multimodal, tie, **text)
    model.save_pretrained(folder)
    model.config.use_cache = False
    ours = HybridModel.from_pretrained(folder, progress=False)
    prompts = random_streams(ours.config.vocab_size, [5, 17, 40], seed=3)
    with Engine(ours, compile=False, **sizes) as engine:
        results = engine.generate(prompts, max_new_tokens=4, stop_token_ids=[], logprobs=0, prompt_logprobs=0)
    for prompt, r in zip(prompts, results):
        room = sizes.get("max_context", 10**9) - len(prompt)
        assert len(r.token_ids) == min(4, room) and r.finish_reason == "length"
        ref = hf_logits(model, prompt + r.token_ids).log_softmax(-1)[:-1]  # row i: the next token after token i
        assert r.token_ids == ref[len(prompt) - 1:].argmax(-1).tolist()
        got = [x.logprob for x in r.prompt_logprobs[1:] + r.logprobs]
        want = ref.gather(1, torch.tensor(prompt[1:] + r.token_ids)[:, None])[:, 0]
        assert rel_err(torch.tensor(got), want) <= 1e-4

def assert_mtp_head(model, head: dict[str, torch.Tensor]) -> None:
    """The model holds the MTP head `head` (checkpoint tensors, mtp_head's) in its dtype, and nothing else under
    mtp. (no head: model.mtp is None)."""
    from metrale_graph.weights import to_checkpoint

    if not head:
        assert model.mtp is None
        return
    stored = {k: v for k, v in to_checkpoint(dict(model.named_parameters()), model.config).items()
              if k.startswith("mtp.")}
    assert sorted(stored) == sorted(head)
    for key, tensor in head.items():
        assert torch.equal(stored[key], tensor.to(stored[key].dtype)), key



@pytest.mark.parametrize("family, multimodal",
                         [("qwen3_5_text", False), ("qwen3_next", False), ("qwen3_5_moe_text", True)],
                         ids=["qwen3_5", "qwen3_next", "mm-qwen3_5_moe"])
def test_tied_checkpoint_that_stores_lm_head_for_the_pair(tmp_path, family, multimodal):
    """safetensors' save_model writes one name of each tied pair, lm_head.weight (the first in sort order),
    where transformers' save_pretrained writes model.embed_tokens.weight; transformers loads either, taking
    the embeddings from lm_head. It was refused: 'lacks embed_tokens.weight'."""
    from safetensors.torch import save_model

    folder = str(tmp_path)
    model = transformers_model(family, multimodal, tie=True)
    model.save_pretrained(folder)
    os.unlink(os.path.join(folder, "model.safetensors"))
    save_model(model, os.path.join(folder, "model.safetensors"))
    keys = load_file(os.path.join(folder, "model.safetensors"))
    assert "lm_head.weight" in keys and not any(k.endswith("embed_tokens.weight") for k in keys)
    ours = HybridModel.from_pretrained(folder, progress=False)
    check_parity(ours, load_transformers(folder, multimodal), ours.config, LENGTHS)


@pytest.mark.parametrize("family, multimodal", [("qwen3_5_text", False), ("qwen3_5_moe_text", True)],
                         ids=["qwen3_5", "mm-qwen3_5_moe"])
def test_rotary_inv_freq_buffers_are_skipped_as_transformers_skips_them(tmp_path, monkeypatch, family, multimodal):
    """Checkpoints written from a module's buffers as well as its parameters (older transformers, conversion scripts)
    carry the RoPE frequencies, `rotary_emb.inv_freq`, at the model or in each attention layer: transformers ignores
    them by name (_adjust_missing_and_unexpected_keys) and loads the folder; here they were 'unexpected tensor(s)'.
    They are skipped unread, sharded or not; any other stray tensor is still refused."""
    folder = str(tmp_path)
    transformers_model(family, multimodal).save_pretrained(folder, **({"max_shard_size": "60KB"} if multimodal else {}))
    prefix = "model.language_model." if multimodal else "model."
    stray = {prefix + "rotary_emb.inv_freq": torch.ones(4), prefix + "layers.3.self_attn.rotary_emb.inv_freq":
             torch.ones(4), "model.visual.rotary_pos_emb.inv_freq": torch.ones(4)}
    add_tensors(folder, stray)
    hf = load_transformers(folder, multimodal)
    read = data_reads(monkeypatch)
    ours = HybridModel.from_pretrained(folder, progress=False)
    assert read and not set(read) & set(stray), read
    monkeypatch.undo()
    check_parity(ours, hf, ours.config, LENGTHS)
    add_tensors(folder, {prefix + "rotary_emb.weight": torch.ones(4)})
    with pytest.raises(ValueError, match=r"1 unexpected tensor\(s\), e\.g\. '" + re.escape(prefix + "rotary_emb.weight")):
        HybridModel.from_pretrained(folder, progress=False)


FULL_FIRST = ["full_attention", "linear_attention", "linear_attention", "full_attention"]


@pytest.mark.parametrize("family, edit, message", [
    ("qwen3_5_text", dict(layer_types=FULL_FIRST),
     r"layer_types makes layer\(s\) 0 'full_attention' where the checkpoint holds linear_attn\.\* \('linear_attention'"),
    ("qwen3_5_text", dict(layer_types=["linear_attention"] * 4),
     r"layer_types makes layer\(s\) 3 'linear_attention' where the checkpoint holds self_attn\.\* \('full_attention'"),
    ("qwen3_next", dict(mlp_only_layers=[1, 2]), r"the config gives layer\(s\) 1, 2 a dense MLP \(mlp_only_layers "
                                                 r"\[1, 2\]\) where the checkpoint holds a MoE block"),
    ("qwen3_next", dict(decoder_sparse_step=2), r"the config gives layer\(s\) 0, 2 a dense MLP \(decoder_sparse_step 2\)"),
    ("qwen3_next", dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"]),
     r"linear_attn\.in_proj_qkvz and in_proj_ba, fused as 'qwen3_next' checkpoints store them; the config's "
     r"model_type is 'qwen3_5_moe_text'"),
    ("qwen3_5_moe_text", dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"]),
     r"model_type 'qwen3_next' checkpoints fuse linear_attn\.in_proj_qkv with in_proj_z \(in_proj_qkvz\) and "
     r"in_proj_b with in_proj_a \(in_proj_ba\); this one holds them apart"),
    ("qwen3_5_text", dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], num_experts=5,
                          num_experts_per_tok=2, decoder_sparse_step=2),
     r"the config gives layer\(s\) 1, 3 a MoE block where the checkpoint holds a dense MLP"),
], ids=["attention-first", "all-linear", "mlp-only", "sparse-step", "next-as-qwen3_5_moe", "qwen3_5_moe-as-next",
        "dense-as-next"])
def test_config_contradicting_the_checkpoint_names_the_field(tmp_path, family, edit, message):
    """A config.json edited so that it no longer describes its checkpoint (layer_types moved, MoE layers made dense by
    mlp_only_layers or decoder_sparse_step, another family's model_type) was refused as 'checkpoint has 9 unexpected
    tensor(s)', naming tensors but not the setting they contradict. The error now says which layers the config and
    the checkpoint disagree on, and what each holds there."""
    folder = str(tmp_path)
    transformers_model(family, False).save_pretrained(folder)
    edit_config(folder, lambda config: config.update(edit))
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\).*; the config contradicts the checkpoint: .*" + message):
        HybridModel.from_pretrained(folder, progress=False)


def data_reads(monkeypatch) -> list[str]:
    """The checkpoint keys whose data the loader reads from here on (get_tensor, or a slice of get_slice); headers
    (keys, shapes, dtypes) are not counted."""
    import safetensors

    real, read = safetensors.safe_open, []

    class Recorded:
        def __init__(self, h, key):
            self.h, self.key = h, key

        def __getattr__(self, name):
            return getattr(self.h, name)

        def __getitem__(self, index):
            read.append(self.key)
            return self.h[index]

    class Counting:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return Recorded(self.f.get_slice(key), key)

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    return read


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_config_cut_to_fewer_layers_loads_the_first_ones(tmp_path, monkeypatch, caplog, multimodal):
    """A model cut down by editing config.json's num_hidden_layers (and layer_types) below the layers its files hold:
    transformers loads the first layers and warns of the rest, which was refused here ('checkpoint has 25
    unexpected tensor(s)'). The later layers' tensors are skipped from their headers (never read) with one warning
    counting them, the MTP head's tensors still load, and the logits are transformers' own of the cut folder; any
    other stray tensor is still refused."""
    folder = str(tmp_path)
    types = ["linear_attention", "full_attention"] * 2
    family = "qwen3_5_moe_text" if multimodal else "qwen3_5_text"
    transformers_model(family, multimodal, layer_types=types).save_pretrained(folder, max_shard_size="60KB")
    head = mtp_head(family)
    add_tensors(folder, head)

    def cut(config):
        text = config["text_config"] if multimodal else config
        text.update(num_hidden_layers=2, layer_types=types[:2], mtp_num_hidden_layers=1)
    edit_config(folder, cut)
    read = data_reads(monkeypatch)
    with caplog.at_level("WARNING", logger="metrale_graph.loader"):
        ours = HybridModel.from_pretrained(folder, progress=False)
    warned = [r.getMessage() for r in caplog.records if "num_hidden_layers" in r.getMessage()]
    assert len(warned) == 1 and "2 decoder layer(s)" in warned[0], warned
    assert read and not any(re.search(r"layers\.[23]\.", k) and not k.startswith("mtp.") for k in read), read
    assert ours.config.num_hidden_layers == 2
    assert_mtp_head(ours, head)
    monkeypatch.undo()
    check_parity(ours, load_transformers(folder, multimodal), ours.config, LENGTHS)
    prefix = "model.language_model." if multimodal else "model."
    add_tensors(folder, {prefix + "stray.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"1 unexpected tensor\(s\), e\.g\. '" + re.escape(prefix + "stray.weight")):
        HybridModel.from_pretrained(folder, progress=False)

# ---- FP8 --------------------------------------------------------------------------------------------

def fp8_shapes(family: str, aligned: bool) -> dict:
    """Text sizes for an FP8 checkpoint. `aligned`: every converted weight of Qwen3.5 in whole 128-blocks (as
    transformers' quantizer needs); else ragged hidden / intermediate sizes. Qwen3-Next: 128-row key / value
    heads (its fused in_proj_qkvz splits on 128-row blocks)."""
    if aligned:
        return dict(hidden_size=128, intermediate_size=256, head_dim=64, linear_key_head_dim=32,
                    linear_value_head_dim=32)
    out = dict(hidden_size=136, intermediate_size=200)
    if family != "qwen3_5_text":
        out.update(moe_intermediate_size=72, shared_expert_intermediate_size=40)
    if family == "qwen3_next":
        out.update(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=1)
    return out


@contextlib.contextmanager
def pretend_cuda():
    """transformers quantizes to FP8 only where it sees a GPU (sm 8.9+): let it see one while it quantizes (its
    quantize rule is plain torch; no kernel runs)."""
    available, capability = torch.cuda.is_available, torch.cuda.get_device_capability
    torch.cuda.is_available, torch.cuda.get_device_capability = (lambda: True), (lambda *a: (9, 0))
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.get_device_capability = available, capability


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_transformers_fp8_quantizer_checkpoint(tmp_path, multimodal):
    """Qwen3.5 quantized by transformers' FineGrainedFP8 quantizer (quantize on load, then save_pretrained), the
    modules Qwen keeps listed as patterns: our loader holds its FP8 weights as they are, and runs them as
    transformers runs its own dequantization of that folder. (transformers' save of FP8 MoE experts writes
    squeezed per-expert scales it cannot read back itself: the next test; the MoE families in Qwen's layout are
    written by hand below.)"""
    pytest.importorskip("accelerate")  # transformers needs it for FP8 checkpoints
    import transformers

    src, dst = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    transformers_model("qwen3_5_text", multimodal, **fp8_shapes("qwen3_5_text", aligned=True)).save_pretrained(src)
    cls = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
    quant = transformers.FineGrainedFP8Config(
        weight_block_size=[128, 128], modules_to_not_convert=["lm_head", "in_proj_a", "in_proj_b", "model.visual"])
    with pretend_cuda():
        cls.from_pretrained(src, quantization_config=quant, dtype=torch.bfloat16).save_pretrained(dst)
    ours = HybridModel.from_pretrained(dst, progress=False)
    fp8 = {n for n, p in ours.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert {"layers.0.linear_attn.in_proj_qkv.weight", "layers.3.self_attn.k_proj.weight",
            "layers.0.mlp.down_proj.weight"} <= fp8 and "layers.0.linear_attn.in_proj_a.weight" not in fp8
    assert weight_only_error(ours, load_transformers(dst, multimodal, fp8=True)) <= fp32_model_bound(
        ours.config, max(LENGTHS))


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
def test_transformers_fp8_quantizer_moe_checkpoint_with_squeezed_expert_scales(tmp_path, family):
    """An MoE model quantized by transformers' FineGrainedFP8 quantizer and saved: its per-expert weight_scale_inv
    come out with their size-1 dims dropped (a [1, 1] grid as a 0-d tensor, [2, 1] and [1, 2] as [2]), which
    transformers cannot read back itself; the loader refused them ('has shape (2,), the config needs (1, 2)'). Such
    a scale is the grid's values in order (only dims of 1 dropped, nothing transposed), so it loads as the grid; the
    reference is transformers' dequantization of the same folder with the grids restored."""
    pytest.importorskip("accelerate")
    import transformers

    src, dst = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    sizes = {**fp8_shapes(family, aligned=True), "moe_intermediate_size": 256, "shared_expert_intermediate_size": 128}
    if family == "qwen3_next":  # its fused in_proj_qkvz splits on 128-row blocks
        sizes.update(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                     linear_num_value_heads=1)
    transformers_model(family, False, **sizes).save_pretrained(src)
    quant = transformers.FineGrainedFP8Config(
        weight_block_size=[128, 128], modules_to_not_convert=["lm_head", "in_proj_a", "in_proj_b", "in_proj_ba",
                                                              "mlp.gate", "shared_expert_gate"])
    with pretend_cuda():
        transformers.AutoModelForCausalLM.from_pretrained(src, quantization_config=quant,
                                                          dtype=torch.bfloat16).save_pretrained(dst)

    def rewritten(name: str, tensors: dict[str, torch.Tensor]) -> str:
        folder = str(tmp_path / name)
        os.makedirs(folder)
        with open(os.path.join(dst, "config.json")) as f, open(os.path.join(folder, "config.json"), "w") as g:
            g.write(f.read())
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return folder

    tensors = load_file(os.path.join(dst, "model.safetensors"))
    for key, t in tensors.items():
        if key.endswith("weight_scale_inv"):
            rows, cols = tensors[key[:-len("_scale_inv")]].shape
            tensors[key] = t.reshape(-(-rows // 128), -(-cols // 128))
    grids = rewritten("grids", tensors)
    key = "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"  # its grid [1, 2]: stored [2, 1] is refused
    with pytest.raises(ValueError, match=re.escape(f"{key!r} has shape (2, 1), the config needs (1, 2)")):
        HybridModel.from_pretrained(rewritten("transposed", {**tensors, key: tensors[key].reshape(2, 1)}),
                                    progress=False)
    ours = HybridModel.from_pretrained(dst, progress=False)
    assert dict(ours.named_parameters())["layers.0.mlp.experts.down_proj"].dtype == torch.float8_e4m3fn
    assert weight_only_error(ours, load_transformers(grids, False, fp8=True)) <= fp32_model_bound(
        ours.config, max(LENGTHS))


def weight_only_error(ours, hf) -> float:
    """The largest relative error of our FP8 model's logits (activations not rounded) against `hf`'s."""
    streams = random_streams(ours.config.vocab_size, LENGTHS)
    cache = ours.new_cache(num_slots=len(LENGTHS) + 1, num_blocks=32, block_size=16)
    with activation_rounding(False):
        out = ours.prefill(cache, [Stream(i + 1, t) for i, t in enumerate(streams)])
    return max(rel_err(out[i], hf_logits(hf, t)[-1]) for i, t in enumerate(streams))


# Qwen's FP8 layout, written from the format's description (issue 26) with plain torch
CONVERTED = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_qkvz|out_proj|gate_proj|"
                       r"up_proj|down_proj|fc)\.weight$")
EXPERT = re.compile(r"(model\..*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


def quantize_block(w: torch.Tensor, scale_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes, scale_inv [ceil(N/128), ceil(K/128)] in scale_dtype): per 128 x 128 block,
    ragged last blocks included, scale = amax / 448 as stored (rounded to scale_dtype), codes = w / scale."""
    N, K = w.shape
    codes = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-N // 128), -(-K // 128), dtype=scale_dtype)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = block.abs().max()
            scale[i, j] = amax / 448 if amax > 0 else 1.0
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale[i, j].float()).clamp(-448, 448).to(
                torch.float8_e4m3fn)
    return codes, scale


def dequantize_block(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:codes.shape[0], :codes.shape[1]]
    return codes.float() * full


def stack_experts(tensors: dict[str, torch.Tensor]) -> None:
    """Per-expert tensors (and scales) -> stacked `experts.gate_up_proj` [E, 2I, D] (gate rows, then up) and
    `experts.down_proj` [E, D, I], with `..._scale_inv` grids likewise where there are any (in place)."""
    groups: dict[str, dict] = {}
    for key in [k for k in tensors if EXPERT.match(k)]:
        base, e, part, leaf = EXPERT.match(key).groups()
        groups.setdefault(base, {})[(part, leaf, int(e))] = tensors.pop(key)
    for base, g in groups.items():
        experts = range(1 + max(e for _, _, e in g))
        for leaf, suffix in (("weight", ""), ("weight_scale_inv", "_scale_inv")):
            if ("gate_proj", leaf, 0) not in g:  # (a floating-point checkpoint: no scales)
                continue

            def stacked(parts):
                rows = [torch.cat([g[(p, leaf, e)] for p in parts]) for e in experts]
                if rows[0].dtype == torch.float8_e4m3fn:  # no torch.stack of float8 on the CPU: through its bytes
                    return torch.stack([r.view(torch.uint8) for r in rows]).view(torch.float8_e4m3fn)
                return torch.stack(rows)
            tensors[f"{base}.gate_up_proj{suffix}"] = stacked(("gate_proj", "up_proj"))
            tensors[f"{base}.down_proj{suffix}"] = stacked(("down_proj",))


def write_qwen_fp8(src: str, dst: str, *, text_config: bool, scale_dtype=torch.bfloat16, shards: int = 3,
                   stacked: bool = False, mtp: dict | None = None) -> str:
    """Quantize the transformers checkpoint `src` into `dst` as Qwen's FP8 releases are written: the
    projections float8_e4m3fn with weight_scale_inv, the router, shared-expert gate, GDN a / b, lm_head, the
    vision tower, norms and embeddings kept and listed by full module name in modules_to_not_convert; the
    quantization_config at the top of config.json or in text_config; `shards` files with an index; `mtp` (an
    MTP head, quantized like the model) added. Returns a folder with the same checkpoint dequantized (fp32,
    no quantization_config): what transformers' unquantized model of it computes with."""
    os.makedirs(dst)
    ref = dst + "-dequantized"
    os.makedirs(ref)
    config, tensors = read_checkpoint(src)
    tensors.update(mtp or {})
    out, dequantized, kept = {}, {}, []
    for key, w in sorted(tensors.items()):
        if CONVERTED.match(key) and not key.startswith("model.visual."):
            codes, scale = quantize_block(w, scale_dtype)
            out[key], out[key[:-len("weight")] + "weight_scale_inv"] = codes, scale
            dequantized[key] = dequantize_block(codes, scale)
        else:
            out[key], dequantized[key] = w, w.float()
            if key.endswith(".weight"):  # a module (linear, norm, conv, embedding) kept in floating point
                kept.append(key[:-len(".weight")])
    if stacked:
        stack_experts(out)
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
             "modules_to_not_convert": kept}
    quantized = dict(config)
    if text_config:
        quantized["text_config"] = {**config["text_config"], "quantization_config": quant}
    else:
        quantized["quantization_config"] = quant
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(quantized, f, indent=2)
    write_sharded(dst, out, shards)
    with open(os.path.join(ref, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(dequantized, os.path.join(ref, "model.safetensors"), metadata={"format": "pt"})
    return ref


@pytest.mark.parametrize("family, multimodal, text_config, scale_dtype, stacked", [
    pytest.param("qwen3_5_moe_text", True, True, torch.bfloat16, False, id="mm-qwen3_5_moe-text_config-bf16-scales"),
    pytest.param("qwen3_5_moe_text", False, False, torch.float32, True, id="qwen3_5_moe-stacked-experts-fp32-scales"),
    pytest.param("qwen3_next", False, False, torch.bfloat16, False, id="qwen3_next-bf16-scales"),
    pytest.param("qwen3_5_text", True, False, torch.bfloat16, False, id="mm-qwen3_5-top-level-bf16-scales"),
])
def test_qwen_layout_fp8_checkpoints(tmp_path, family, multimodal, text_config, scale_dtype, stacked):
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    sizes = fp8_shapes(family, aligned=False)
    if stacked:  # stacked gate|up scales are unambiguous only on whole 128-row parts (the next test); at 256
        # stacked and per-expert tensors give the same error (6.6e-6; 1.2e-5 both at 128: fp32 rounding of the draws)
        sizes["moe_intermediate_size"] = 256
    transformers_model(family, multimodal, **sizes).to(torch.bfloat16).save_pretrained(src)
    ref = write_qwen_fp8(src, dst, text_config=text_config, scale_dtype=scale_dtype, stacked=stacked,
                         mtp=mtp_head(family, **sizes))
    ours = HybridModel.from_pretrained(dst, progress=False)
    kinds = {n.split(".")[-2] for n, p in ours.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert {"in_proj_qkv", "out_proj", "o_proj"} <= kinds and not kinds & {"in_proj_a", "in_proj_b", "gate"}
    assert weight_only_error(ours, load_transformers(ref, multimodal)) <= fp32_model_bound(ours.config, max(LENGTHS))


def test_stacked_fp8_experts_of_ragged_parts_are_refused_by_name(tmp_path):
    """Stacked gate|up experts of 72 rows a part: ceil(144 / 128) = 2 * ceil(72 / 128) row blocks, so the
    fused matrix's blocks (transformers') and each part's own (Qwen's per-expert tensors, stacked) give one
    grid shape with two meanings: refused by name, before anything is allocated."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    sizes = fp8_shapes("qwen3_5_moe_text", aligned=False)
    transformers_model("qwen3_5_moe_text", False, **sizes).to(torch.bfloat16).save_pretrained(src)
    write_qwen_fp8(src, dst, text_config=False, stacked=True)
    with pytest.raises(ValueError, match=r"gate_up_proj_scale_inv.*stacked experts.*72 rows each"):
        HybridModel.from_pretrained(dst, progress=False)


QUANTIZED = {  # config.json's quantization_config as each tool writes it (compressed-tensors: llm-compressor's W4A16;
    # its FP8 formats load, tests/test_checkpoints_compressed.py)
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status":
                           "compressed", "ignore": ["lm_head"],
                           "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                         "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                                     "strategy": "group", "group_size": 128}}}},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
}


@pytest.fixture(scope="module")
def qwen3_5_folder(tmp_path_factory):
    """A Qwen3.5 checkpoint transformers wrote, one file."""
    folder = str(tmp_path_factory.mktemp("qwen3_5"))
    transformers_model("qwen3_5_text", False).save_pretrained(folder)
    return folder


def copy_of(folder, tmp_path) -> str:
    import shutil

    return shutil.copytree(folder, str(tmp_path / "copy"))


@pytest.mark.parametrize("method", list(QUANTIZED))
def test_other_quantization_methods_are_refused_by_name(qwen3_5_folder, tmp_path, method):
    folder = copy_of(qwen3_5_folder, tmp_path)
    edit_config(folder, lambda c: c.update(quantization_config=QUANTIZED[method]))
    with pytest.raises(ValueError, match=f"quant_method '{method}'.* is not supported: .*fine-grained FP8 .*Load the "
                                         "model's floating-point checkpoint, or its FP8 one in Qwen's format"):
        HybridModel.from_pretrained(folder, progress=False)


@pytest.mark.parametrize("flag", ["load_in_4bit", "load_in_8bit"])
def test_bitsandbytes_config_without_quant_method_is_named(qwen3_5_folder, tmp_path, flag):
    """bitsandbytes' older quantization_config names no quant_method, only load_in_4bit / load_in_8bit (transformers
    reads those flags first, as bitsandbytes, whatever quant_method says): refused naming bitsandbytes. It was
    'quant_method None', naming no format."""
    folder = copy_of(qwen3_5_folder, tmp_path)
    edit_config(folder, lambda c: c.update(quantization_config={flag: True, "bnb_4bit_quant_type": "nf4",
                                                                "llm_int8_threshold": 6.0}))
    with pytest.raises(ValueError, match=f"quantization_config with {flag} true: bitsandbytes' {flag[8]}-bit weights, "
                                         "quant_method 'bitsandbytes'\\) is not supported"):
        HybridModel.from_pretrained(folder, progress=False)


def packed(kind: str, w: torch.Tensor, module: str) -> dict[str, torch.Tensor]:
    """A linear weight w [N, K] as each quantized format's writer stores it (the names, dtypes and shapes; the values
    do not matter here): AutoGPTQ / AutoAWQ's int4 packed into int32, bitsandbytes' nf4 and int8, MLX's 4-bit."""
    N, K = w.shape
    i32 = lambda *shape: torch.zeros(*shape, dtype=torch.int32)  # noqa: E731
    return {
        "gptq": {module + ".qweight": i32(K // 8, N), module + ".qzeros": i32(1, N // 8),
                 module + ".scales": torch.ones(1, N, dtype=torch.float16), module + ".g_idx": i32(K)},
        "awq": {module + ".qweight": i32(K, N // 8), module + ".qzeros": i32(1, N // 8),
                module + ".scales": torch.ones(1, N, dtype=torch.float16)},
        "bnb-4bit": {module + ".weight": torch.zeros(N * K // 2, 1, dtype=torch.uint8),
                     module + ".weight.absmax": torch.ones(N * K // 64), module + ".weight.quant_map": torch.ones(16),
                     module + ".weight.quant_state.bitsandbytes__nf4": torch.zeros(64, dtype=torch.uint8)},
        "bnb-8bit": {module + ".weight": torch.zeros(N, K, dtype=torch.int8), module + ".SCB": torch.ones(N)},
        "mlx": {module + ".weight": torch.zeros(N, K // 8, dtype=torch.int32).view(torch.uint32),
                module + ".scales": torch.ones(N, 1, dtype=torch.bfloat16),
                module + ".biases": torch.zeros(N, 1, dtype=torch.bfloat16)},
    }[kind]


@pytest.mark.parametrize("kind, named", [
    ("gptq", r"GPTQ \(int4 weights packed into int32"), ("awq", r"GPTQ / AWQ \(int4"),
    ("bnb-4bit", r"bitsandbytes 4-bit \(weight\.absmax"), ("bnb-8bit", r"bitsandbytes 8-bit \(int8 weights with SCB"),
    ("mlx", r"MLX \(weights packed into uint32")])
def test_quantized_tensors_without_their_quantization_config_name_the_format(qwen3_5_folder, tmp_path, kind, named):
    """A GPTQ, AWQ, bitsandbytes or MLX checkpoint whose config.json does not declare it (AutoGPTQ and AutoAWQ kept
    their settings in quantize_config.json / quant_config.json; a config copied from the floating-point model): the
    error names the format from its tensors before any other check. It named a mis-shaped or non-float `weight`
    (bitsandbytes, MLX) or a list of unexpected tensors (GPTQ, AWQ), as if the checkpoint were damaged."""
    folder = copy_of(qwen3_5_folder, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for key in [k for k in tensors if k.endswith(("mlp.down_proj.weight", "self_attn.o_proj.weight"))]:
        tensors.update(packed(kind, tensors.pop(key), key[:-len(".weight")]))
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"checkpoint holds {named}.* tensors \\('model\\.layers\\..*' in "
                                         f"{re.escape(path)}\\): a quantized format metrale-graph does not load"):
        HybridModel.from_pretrained(folder, progress=False)


# ---- folders no loader should take -------------------------------------------------------------------

def to_pickles(folder) -> None:
    """What transformers wrote before safetensors: pytorch_model.bin, or its shards with their index."""
    index = os.path.join(folder, "model.safetensors.index.json")
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        name = os.path.basename(path).replace("model", "pytorch_model", 1).replace(".safetensors", ".bin")
        torch.save(load_file(path), os.path.join(folder, name))
        os.unlink(path)
    if os.path.isfile(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"] = {k: v.replace("model", "pytorch_model", 1).replace(".safetensors", ".bin")
                              for k, v in data["weight_map"].items()}
        with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
            json.dump(data, f)
        os.unlink(index)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_pickle_only_checkpoint_is_refused_naming_its_files(tmp_path, sharded):
    """A checkpoint in PyTorch's pickle format (pytorch_model.bin, or shards with pytorch_model.bin.index.json)
    is refused naming its files and what to do; the error said only that no model.safetensors was there."""
    folder = str(tmp_path)
    transformers_model("qwen3_5_text", False).save_pretrained(folder, **({"max_shard_size": "60KB"} if sharded else {}))
    to_pickles(folder)
    name = "pytorch_model.bin.index.json" if sharded else "pytorch_model.bin"
    with pytest.raises(ValueError, match=f"no model.safetensors .* PyTorch pickle weights .*{re.escape(name)}.*"
                                         "safetensors"):
        HybridModel.from_pretrained(folder, progress=False)


def test_shards_without_their_index_are_refused_naming_them(tmp_path):
    """Shards whose index is missing (a download cut short): the error names the shards and the index it
    lacks; it said only that no model.safetensors was there."""
    folder = str(tmp_path)
    transformers_model("qwen3_5_text", False).save_pretrained(folder, max_shard_size="60KB")
    os.unlink(os.path.join(folder, "model.safetensors.index.json"))
    with pytest.raises(ValueError, match=r"\d+ safetensors files \('model-00001-of-\d+\.safetensors', .*but no "
                                         r"model\.safetensors\.index\.json"):
        HybridModel.from_pretrained(folder, progress=False)


def test_fp8_tensors_without_a_quantization_config_name_the_missing_field(tmp_path):
    """An FP8 checkpoint whose config.json lost its quantization_config (edited by hand, or the text config
    of a multimodal one copied alone): the error names the missing field (and the scales, or an FP8 projection
    stored without its config); it said only that
    the checkpoint had unexpected tensors."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    transformers_model("qwen3_5_text", False, **fp8_shapes("qwen3_5_text", aligned=False)).save_pretrained(src)
    write_qwen_fp8(src, dst, text_config=False, shards=1)
    edit_config(dst, lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"FP8 block scale\(s\) but its config\.json has no quantization_config .*"
                                         r"in_proj_qkv\.weight_scale_inv|in_proj_qkv\.weight' .* is float8_e4m3fn, "
                                         r"but config\.json has no quantization_config"):
        HybridModel.from_pretrained(dst, progress=False)


def test_fp8_projections_without_scales_or_a_quantization_config_are_refused(tmp_path):
    """FP8 codes stored alone (the quantization_config and every weight_scale_inv dropped): they are not the
    weights, and loading them as unscaled floats gave logits 1.4 (relative) from the true ones. The error
    names an FP8 projection and the missing field, before anything is read."""
    from safetensors.torch import load_file, save_file

    src, dst = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    transformers_model("qwen3_5_text", False, **fp8_shapes("qwen3_5_text", aligned=False)).save_pretrained(src)
    write_qwen_fp8(src, dst, text_config=False, shards=1)
    edit_config(dst, lambda c: c.pop("quantization_config"))
    (path,) = glob.glob(os.path.join(dst, "*.safetensors"))
    tensors = {k: v for k, v in load_file(path).items() if not k.endswith("_scale_inv")}
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"is float8_e4m3fn, but config\.json has no quantization_config"):
        HybridModel.from_pretrained(dst, progress=False)


def test_folder_without_config_json(qwen3_5_folder, tmp_path):
    """A folder of weights without config.json (a download cut short, an adapter folder): the error says so.
    It said the folder was "neither a preset (tiny, ...) nor a checkpoint folder with a config.json", though
    from_pretrained takes no preset."""
    folder = copy_of(qwen3_5_folder, tmp_path)
    os.unlink(os.path.join(folder, "config.json"))
    with pytest.raises(ValueError) as e:
        HybridModel.from_pretrained(folder, progress=False)
    assert re.search(f"checkpoint folder '{re.escape(folder)}' has no config.json", str(e.value)), e.value
    assert "preset" not in str(e.value)  # from_pretrained reads folders only


# ---- what config.json says of the model: its kind, its tie, its dtype --------------------------------

@pytest.mark.parametrize("edit, message", [
    (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"]), r"architectures \['Qwen3ForCausalLM'\] \(model_type "
                                                                   r"'qwen3'\) names no model metrale-graph runs"),
    (dict(architectures=["Qwen3_5ForSequenceClassification"]), r"Qwen3_5ForSequenceClassification.*runs causal "
                                                               r"language models of Qwen3_5ForCausalLM"),
    (dict(architectures="Qwen3_5ForCausalLM"), r"field 'architectures' must be a list of class names"),
    (dict(model_type=None), r"no 'model_type' field .*architectures \['Qwen3_5ForCausalLM'\]"),
], ids=["other-model", "sequence-classifier", "not-a-list", "no-model_type"])
def test_config_naming_another_kind_of_model_is_refused_by_name(qwen3_5_folder, tmp_path, edit, message):
    """A config.json whose architectures names a model that is not one of ours (another family, a classifier
    head over a supported model_type) or that has no model_type: a ValueError naming the field and what runs
    here, before any weight is read. A classifier over a supported model_type loaded as a causal LM, and a
    missing model_type was called "unsupported model_type None"."""
    folder = copy_of(qwen3_5_folder, tmp_path)
    edit_config(folder, lambda c: (c.update(edit), [c.pop(k) for k, v in edit.items() if v is None]))
    with pytest.raises(ValueError, match=message):
        HybridModel.from_pretrained(folder, progress=False)
    from metrale_graph import load_config

    with pytest.raises(ValueError, match=message):  # the tools' --model check reads the same
        load_config(folder)


def test_multimodal_config_tied_in_its_text_config_alone(tmp_path):
    """A multimodal config.json without a top-level tie_word_embeddings whose text_config ties (written by hand,
    as vLLM reads it) over a checkpoint that stores no lm_head: the pair is tied, the same logits as transformers
    on the folder with the flag at the top. It was refused as lacking lm_head.weight (transformers runs a random
    lm_head there). An explicit top-level false over such a checkpoint names tie_word_embeddings."""
    tied, folder = str(tmp_path / "tied"), str(tmp_path / "text-tied")
    transformers_model("qwen3_5_text", True, tie=True).save_pretrained(tied)
    import shutil

    shutil.copytree(tied, folder)
    edit_config(folder, lambda c: (c.pop("tie_word_embeddings"), c["text_config"].update(tie_word_embeddings=True)))
    ours = HybridModel.from_pretrained(folder, progress=False)
    assert ours.config.tie_word_embeddings
    check_parity(ours, load_transformers(tied, True), ours.config, LENGTHS)
    edit_config(folder, lambda c: c.update(tie_word_embeddings=False))
    with pytest.raises(ValueError, match=r"lacks lm_head\.weight and its config does not tie .*tie_word_embeddings "
                                         r"true in config\.json"):
        HybridModel.from_pretrained(folder, progress=False)


@pytest.mark.parametrize("field, stored, multimodal", [
    ("torch_dtype", "bfloat16", False), ("dtype", "float16", True), ("dtype", "float32", False),
    (None, "bfloat16", True)], ids=["torch_dtype-bf16", "mm-text_config-dtype-fp16", "dtype-fp32", "mm-none-bf16"])
def test_auto_dtype_is_the_checkpoints_own_and_an_explicit_one_overrides(tmp_path, field, stored, multimodal):
    """dtype="auto" loads in the dtype config.json names (transformers 5's `dtype`, 4.x's `torch_dtype`; a
    multimodal config's text_config first), else in the one the embeddings are stored in, as transformers'
    dtype="auto"; an explicit dtype overrides it; the weights are the stored ones. "auto" was an unsupported
    dtype. A dtype the model does not run in is named with its field."""
    folder = str(tmp_path)
    transformers_model("qwen3_5_text", multimodal).to(getattr(torch, stored)).save_pretrained(folder)

    def edit(config):
        for section in (config, config.get("text_config", {})):
            section.pop("dtype", None)
            section.pop("torch_dtype", None)
        if field:
            (config["text_config"] if multimodal else config)[field] = stored
        if field and multimodal:
            config["dtype"] = "float32"  # a multimodal one's top level is read after its text_config
    edit_config(folder, edit)
    auto = HybridModel.from_pretrained(folder, progress=False, dtype="auto")
    assert auto.dtype == getattr(torch, stored)
    stored_embeddings = next(t for k, t in load_file(os.path.join(folder, "model.safetensors")).items()
                             if k.endswith("embed_tokens.weight"))
    assert torch.equal(auto.embed_tokens.weight, stored_embeddings)
    assert HybridModel.from_pretrained(folder, progress=False, dtype="float16").dtype == torch.float16
    assert HybridModel.from_pretrained(folder, progress=False).dtype == torch.float32  # the default stays float32
    edit_config(folder, lambda c: (c.get("text_config", c).update(torch_dtype="int8"), c.get("text_config", c).pop(
        "dtype", None)))
    with pytest.raises(ValueError, match=r"dtype='auto' reads 'torch_dtype' of .*config\.json: unsupported dtype "
                                         r"'int8'"):
        HybridModel.from_pretrained(folder, progress=False, dtype="auto")


def test_tokenizer_folder_without_config_json_names_it_to_the_tools(tmp_path):
    """A folder of tokenizer files alone given as --model: load_config (the tools' flag check) says the folder
    has no config.json; it said the folder was "neither a preset (...) nor a checkpoint folder"."""
    from tokenizer_fixture import build_tokenizer

    from metrale_graph import load_config

    folder = build_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match=f"checkpoint folder '{re.escape(folder)}' has no config.json .*; it holds a "
                                         "tokenizer's files only"):
        load_config(folder)
    with pytest.raises(ValueError, match="has no config.json .*; it holds a tokenizer's files only"):
        HybridModel.from_pretrained(folder, progress=False)


def test_peft_adapter_folder_is_named_as_such(tmp_path):
    """A PEFT LoRA adapter's folder (adapter_config.json, adapter_model.safetensors) given as a model: the error says
    it is an adapter and how to make a model of it; it said only that config.json was missing."""
    from metrale_graph import load_config

    folder = str(tmp_path)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "base_model_name_or_path": "Qwen/Qwen3.5-9B", "r": 8,
                   "target_modules": ["q_proj", "v_proj"]}, f)
    save_file({"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight": torch.zeros(8, 48)},
              os.path.join(folder, "adapter_model.safetensors"))
    for load in (load_config, lambda f: HybridModel.from_pretrained(f, progress=False)):
        with pytest.raises(ValueError, match=r"has no config\.json .*; it holds a PEFT adapter \(adapter_config\.json\)"
                                             r", not a model: merge it into its base model"):
            load(folder)


def test_incomplete_mtp_head_names_the_way_to_load_without_it(tmp_path):
    """An MTP head missing a tensor (a tool that kept part of `mtp.*`; transformers never reads the head): the
    error names the tensor and says mtp=False loads the model without the head, which then matches transformers.
    It named the tensor only, as if the model itself were incomplete."""
    folder = str(tmp_path)
    transformers_model("qwen3_5_moe_text", True).save_pretrained(folder)
    head = mtp_head("qwen3_5_moe_text")
    head.pop("mtp.norm.weight")
    add_tensors(folder, head)
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) .*'mtp\.norm\.weight'.*MTP head \(mtp\.\*\) is "
                                         r"incomplete: from_pretrained\(\.\.\., mtp=False\) loads"):
        HybridModel.from_pretrained(folder, progress=False)
    ours = HybridModel.from_pretrained(folder, progress=False, mtp=False)
    assert ours.mtp is None
    check_parity(ours, load_transformers(folder, True), ours.config, LENGTHS)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors.pop("model.language_model.norm.weight")  # the model lacks a tensor too: no hint
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\)") as e:
        HybridModel.from_pretrained(folder, progress=False)
    assert "mtp=False" not in str(e.value)
