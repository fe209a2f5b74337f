"""The MTP head's weights (issue 39, item 1), on the CPU: the config field of each family; the spec's MTP block and
random heads from presets; heads in checkpoints as Qwen's carry them (test_checkpoints_foreign.mtp_head, written
by transformers' save_pretrained plus the head: declared in config.json or not, under `mtp.` or `model.mtp.`), and
the checkpoints no loader should take as they are (a partial head, an extra layer: named) or that load without a
head (declared but absent, as transformers' own save leaves them; mtp=False); save_pretrained writing the head
back (our loader reads it equal, transformers reads the folder); FP8 heads (Qwen's layout, against the dequantized
checkpoint's head; tools.quantize, against quantize_weights); each tensor-parallel rank's shard of the head and its
drafts (tp = 2 over gloo)."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from helpers import moe_config, tiny_config, unit_gain
from metrics import fp32_model_bound, rel_err
from speculative_reference import prefill_hidden
from test_checkpoints_foreign import (add_tensors, assert_mtp_head, edit_config, fp8_shapes, load_transformers,
                                      mtp_head, transformers_model, write_qwen_fp8)
from metrale_graph import HybridModel, ModelConfig, Stream
from metrale_graph.ops.fp8 import activation_rounding
from metrale_graph.quantization import QWEN_KEPT
from metrale_graph.quantized import fp8_config, quantize_weights
from metrale_graph.spec import MLP, MOE, weight_shapes
from metrale_graph.speculative import draft_mtp

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 17, 3, 200, 41, 8, 99, 12, 7]


def drafts_of(model, k: int = 3):
    """draft_mtp's Draft after a prefill of PROMPT (greedy)."""
    cache = model.new_cache(2, 16, 16)
    hidden = prefill_hidden(model, cache, 1, PROMPT)
    first = int(model.head(hidden[-1:])[0].argmax())
    return draft_mtp(model, cache, 1, PROMPT[1:] + [first], hidden, k)


# ---- config and spec ------------------------------------------------------------------------------------------

def test_each_family_reads_and_writes_its_own_mtp_field():
    qwen35 = tiny_config(mtp_num_hidden_layers=1).to_hf()
    assert qwen35["mtp_num_hidden_layers"] == 1 and "num_nextn_predict_layers" not in qwen35
    assert ModelConfig.from_hf(qwen35).mtp_num_hidden_layers == 1
    nxt = moe_config("qwen3_next", mtp_num_hidden_layers=2).to_hf()
    assert nxt["num_nextn_predict_layers"] == 2 and "mtp_num_hidden_layers" not in nxt
    assert ModelConfig.from_hf(nxt).mtp_num_hidden_layers == 2
    assert ModelConfig.from_hf({**nxt, "num_nextn_predict_layers": None, "mtp_num_hidden_layers": 3}
                               ).mtp_num_hidden_layers == 0  # another family's field: ignored
    assert "mtp_num_hidden_layers" not in tiny_config().to_hf()  # no head: no field (transformers' own configs)
    wrapped = {"model_type": "qwen3_5", "text_config": {**qwen35, "model_type": "qwen3_5_text"}}
    assert ModelConfig.from_hf(wrapped).mtp_num_hidden_layers == 1
    with pytest.raises(ValueError, match="'num_nextn_predict_layers' must be an integer >= 0, got -1"):
        ModelConfig.from_hf({**nxt, "num_nextn_predict_layers": -1})
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings is true"):
        ModelConfig.from_hf({**qwen35, "mtp_use_dedicated_embeddings": True})


def test_the_spec_holds_the_head_after_the_model_and_presets_draw_it():
    """The MTP block's names and shapes (Qwen's), after every main weight: a preset with a head draws the same main
    weights as without one. Its layer's feed-forward follows the main rule at the MTP layer's own index (vLLM)."""
    cfg = tiny_config(mtp_num_hidden_layers=1)
    shapes, D = weight_shapes(cfg), cfg.hidden_size
    plain = weight_shapes(tiny_config())
    assert list(shapes)[:len(plain)] == list(plain)
    head = {n: s for n, s in shapes.items() if n.startswith("mtp.")}
    assert head["mtp.fc.weight"] == (D, 2 * D) and head["mtp.norm.weight"] == (D,)
    assert head["mtp.layers.0.self_attn.q_proj.weight"] == shapes["layers.3.self_attn.q_proj.weight"]
    assert head["mtp.layers.0.mlp.down_proj.weight"] == shapes["layers.0.mlp.down_proj.weight"]
    assert len(head) == 4 + 11
    with_head, without = HybridModel.from_preset(cfg, seed=4), HybridModel.from_preset(tiny_config(), seed=4)
    for name, p in without.named_parameters():
        assert torch.equal(p, with_head.get_parameter(name)), name
    assert without.mtp is None and with_head.mtp.fc.weight.shape == (D, 2 * D)
    assert HybridModel.from_preset(moe_config("qwen3_next", mtp_num_hidden_layers=1)).mtp.layers[0].feed_forward == MOE
    sparse_step = moe_config("qwen3_next", num_hidden_layers=4, decoder_sparse_step=2, mtp_num_hidden_layers=2)
    assert [b.feed_forward for b in HybridModel.from_preset(sparse_step).mtp.layers] == [MLP, MOE]


def test_an_fp8_preset_quantizes_the_head_as_the_model():
    cfg = fp8_config(moe_config(hidden_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                                head_dim=64, mtp_num_hidden_layers=1), QWEN_KEPT)
    model = HybridModel.from_preset(cfg)
    fp8 = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.experts.gate_up_proj"} <= fp8
    assert "mtp.layers.0.mlp.gate.weight" not in fp8 and "mtp.norm.weight" not in fp8


# ---- checkpoints --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a folder transformers' save_pretrained wrote for a tiny model of the family (no head)."""
    out = {}
    for family, multimodal in (("qwen3_5_text", False), ("qwen3_next", False), ("qwen3_5_moe_text", True)):
        folder = str(tmp_path_factory.mktemp(family))
        transformers_model(family, multimodal, seed=2).save_pretrained(folder)
        out[family] = (folder, multimodal)
    return out


def copy_with(saved, family, tmp_path, head=None, declare=None):
    """A copy of saved[family] with `head` added and config.json declaring `declare` MTP layers (None: as it is)."""
    import shutil

    folder, multimodal = saved[family]
    copy = shutil.copytree(folder, str(tmp_path / "ckpt"))
    if head:
        add_tensors(copy, head)
    if declare is not None:
        field = "num_nextn_predict_layers" if family == "qwen3_next" else "mtp_num_hidden_layers"
        edit_config(copy, lambda c: (c["text_config"] if multimodal else c).update({field: declare}))
    return copy


@pytest.mark.parametrize("family, declare", [("qwen3_5_text", 1), ("qwen3_next", None), ("qwen3_5_moe_text", 1)],
                         ids=["qwen3_5-declared", "qwen3_next-undeclared", "mm-qwen3_5_moe-declared"])
def test_a_head_saves_back_as_qwen_names_it(saved, tmp_path, family, declare):
    """A whole head loads (declared or not); save_pretrained writes it under Qwen's names with the family's field;
    our loader reads the saved folder equal, transformers reads it (ignoring `mtp.`) to the same logits."""
    head = mtp_head(family, dtype=torch.float32)
    model = HybridModel.from_pretrained(copy_with(saved, family, tmp_path, head, declare), progress=False)
    assert_mtp_head(model, head)
    out = str(tmp_path / "saved")
    model.save_pretrained(out)
    stored = load_file(os.path.join(out, "model.safetensors"))
    assert {k for k in stored if "mtp" in k} == set(head)
    with open(os.path.join(out, "config.json")) as f:
        field = "num_nextn_predict_layers" if family == "qwen3_next" else "mtp_num_hidden_layers"
        assert json.load(f)[field] == 1
    again = HybridModel.from_pretrained(out, progress=False)
    assert_mtp_head(again, head)
    assert drafts_of(again).logits.equal(drafts_of(model).logits)
    hf = load_transformers(out, multimodal=False)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    got = model.prefill(model.new_cache(1, 4, 16), [Stream(0, PROMPT)])[0]
    assert rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("form", ["model.mtp-prefix", "declared-absent", "mtp-False"])
def test_checkpoints_that_load(saved, tmp_path, form):
    """A head under `model.mtp.` loads as Qwen's `mtp.`; a head config.json declares but the files lack (transformers'
    save_pretrained drops it) loads as no head, saved without the field; mtp=False leaves a head unread."""
    head = mtp_head("qwen3_5_text", dtype=torch.float32)
    if form == "model.mtp-prefix":
        folder = copy_with(saved, "qwen3_5_text", tmp_path, {"model." + k: v for k, v in head.items()}, 1)
        assert_mtp_head(HybridModel.from_pretrained(folder, progress=False), head)
    elif form == "declared-absent":
        model = HybridModel.from_pretrained(copy_with(saved, "qwen3_5_text", tmp_path, None, 1), progress=False)
        assert model.mtp is None and model.config.mtp_num_hidden_layers == 0
        model.save_pretrained(str(tmp_path / "out"))
        with open(tmp_path / "out" / "config.json") as f:
            assert "mtp_num_hidden_layers" not in json.load(f)
    else:
        model = HybridModel.from_pretrained(copy_with(saved, "qwen3_5_text", tmp_path, head, 1), progress=False,
                                            mtp=False)
        assert model.mtp is None and not any(n.startswith("mtp") for n, _ in model.named_parameters())


def test_checkpoints_with_a_broken_head_are_refused_by_name(saved, tmp_path):
    """A head missing a tensor, and one with a layer more than config.json declares, are named, not half loaded."""
    head = mtp_head("qwen3_5_text")
    partial = {k: v for k, v in head.items() if k != "mtp.layers.0.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*mtp\.layers\.0\.self_attn\.k_proj\.weight"):
        HybridModel.from_pretrained(copy_with(saved, "qwen3_5_text", tmp_path, partial, 1), progress=False)
    second = {k.replace("mtp.layers.0.", "mtp.layers.1."): v.clone() for k, v in head.items() if "layers.0" in k}
    with pytest.raises(ValueError, match=r"unexpected tensor.*'mtp\.layers\.1\."):
        HybridModel.from_pretrained(copy_with(saved, "qwen3_5_text", tmp_path / "b", {**head, **second}, 1),
                                    progress=False)
    with pytest.raises(ValueError, match="mtp must be True or False"):
        HybridModel.from_pretrained(saved["qwen3_5_text"][0], mtp="no")


def test_a_head_of_two_layers_is_counted_from_the_tensors(saved, tmp_path):
    """Qwen3-Next's config.json need not declare its head: the tensors' layers count."""
    head = mtp_head("qwen3_next", dtype=torch.float32)
    second = {k.replace("mtp.layers.0.", "mtp.layers.1."): v.clone() for k, v in head.items() if "layers.0" in k}
    model = HybridModel.from_pretrained(copy_with(saved, "qwen3_next", tmp_path, {**head, **second}), progress=False)
    assert model.config.mtp_num_hidden_layers == 2 and len(model.mtp.layers) == 2


# ---- FP8 ----------------------------------------------------------------------------------------------------

def test_a_qwen_layout_fp8_head_drafts_as_its_dequantized_head(tmp_path):
    """Qwen's FP8 layout with the head quantized like the model (fc, attention, experts; the router kept): its FP8
    weights load, and its drafts' logits (weight-only) match the dequantized checkpoint's within fp32's reach."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    sizes = fp8_shapes("qwen3_5_moe_text", aligned=False)
    transformers_model("qwen3_5_moe_text", False, **sizes).to(torch.bfloat16).save_pretrained(src)
    ref = write_qwen_fp8(src, dst, text_config=False, mtp=mtp_head("qwen3_5_moe_text", **sizes))
    ours = HybridModel.from_pretrained(dst, progress=False)
    fp8 = {n for n, p in ours.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.experts.down_proj"} <= fp8
    assert "mtp.layers.0.mlp.gate.weight" not in fp8
    with activation_rounding(False):
        got = drafts_of(ours)
    want = drafts_of(HybridModel.from_pretrained(ref, progress=False))
    assert got.tokens == want.tokens
    assert rel_err(got.logits, want.logits) <= 10 * fp32_model_bound(ours.config, len(PROMPT))


def test_the_quantizer_converts_the_head(tmp_path):
    """tools.quantize on a checkpoint with a head: the head's projections converted as the model's, bit for bit
    what quantize_weights gives, and the result loads with its head."""
    from metrale_graph.tools import quantize

    cfg = moe_config(hidden_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=128, head_dim=64,
                     mtp_num_hidden_layers=1)
    model = HybridModel.from_preset(cfg, seed=3).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "bf16"))
    quantize.quantize_checkpoint(str(tmp_path / "bf16"), str(tmp_path / "fp8"))
    loaded = HybridModel.from_pretrained(str(tmp_path / "fp8"), dtype=torch.bfloat16, progress=False)
    want = quantize_weights({n: p.detach().clone() for n, p in model.named_parameters()}, fp8_config(cfg, QWEN_KEPT))
    for name, w in want.items():
        got = loaded.get_parameter(name)
        assert got.dtype == w.dtype and torch.equal(got.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else got,
                                                    w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w), name
    assert loaded.mtp.fc.weight.dtype == torch.float8_e4m3fn


# ---- tensor parallelism -------------------------------------------------------------------------------------

WORLD = 2
TP_CONFIG = moe_config(num_experts=6, mtp_num_hidden_layers=1)


def _tp_worker(rank, folder):
    import torch.distributed as dist

    from metrale_graph.parallel import TensorParallel
    from metrale_graph.weights import shard_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD)
    try:
        full = HybridModel.from_pretrained(os.path.join(folder, "ckpt"), progress=False)
        out = {}
        for moe in ("within", "expert"):
            tp = TensorParallel.current(moe=moe)
            model = HybridModel.from_pretrained(os.path.join(folder, "ckpt"), tp=tp, progress=False)
            want = shard_weights({n: p.detach() for n, p in full.named_parameters() if n.startswith("mtp.")},
                                 full.config, tp)
            out[f"{moe}-shards-equal"] = all(torch.equal(model.get_parameter(n), t) for n, t in want.items())
            draft = drafts_of(model)
            out[moe] = (draft.tokens, draft.logits)
        if rank == 0:
            torch.save(out, os.path.join(folder, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def test_each_rank_holds_its_shard_of_the_head_and_drafts_as_one_process(tmp_path):
    model = unit_gain(HybridModel.from_preset(TP_CONFIG, seed=1), seed=2)
    model.save_pretrained(str(tmp_path / "ckpt"))
    mp.start_processes(_tp_worker, args=(str(tmp_path),), nprocs=WORLD, start_method="spawn")
    out = torch.load(tmp_path / "rank0.pt")
    want = drafts_of(model)
    for moe in ("within", "expert"):
        assert out[f"{moe}-shards-equal"], moe
        tokens, logits = out[moe]
        assert tokens == want.tokens and rel_err(logits, want.logits) <= 1e-5, moe
