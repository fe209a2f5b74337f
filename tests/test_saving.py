"""save_pretrained into folders that already hold a checkpoint: the folder loads the model it saved, in
ours and in transformers; a failed save leaves the folder as it was; which files a loader reads."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import tiny_config
from references import check_parity, hf_class, hf_reference
from metrale_graph import HybridModel


def _same_weights(a, b) -> bool:
    mine = dict(a.named_parameters())
    return set(mine) == {n for n, _ in b.named_parameters()} and all(torch.equal(p, mine[n])
                                                                      for n, p in b.named_parameters())


@pytest.fixture
def sharded_folder(tmp_path):
    """transformers' sharded checkpoint of another config (shards, index, generation_config.json with an
    eos of its own)."""
    folder = tmp_path / "checkpoint"
    hf_reference(tiny_config(hidden_size=32, vocab_size=300)).save_pretrained(folder, max_shard_size="20KB")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 299}))
    assert len([f for f in os.listdir(folder) if f.startswith("model-")]) > 2
    return folder


def test_save_over_a_sharded_checkpoint_loads_what_was_saved(sharded_folder):
    """The stale shards, index and generation_config.json went; ours and transformers load the new model.
    (Before: they stayed, and our loader read the stale index.)"""
    model = HybridModel.from_preset("tiny", seed=3)
    model.save_pretrained(str(sharded_folder))
    assert sorted(os.listdir(sharded_folder)) == ["config.json", "model.safetensors"]
    assert _same_weights(model, HybridModel.from_pretrained(str(sharded_folder), progress=False))
    hf = hf_class(model.config).from_pretrained(str(sharded_folder), dtype=torch.float32).eval()
    check_parity(model, hf, model.config, lengths=[3, 20])


def test_a_stale_index_beside_model_safetensors_is_not_read(tmp_path, sharded_folder):
    """model.safetensors and an index of other shards (what transformers' unsharded save over a sharded one
    leaves): both loaders read model.safetensors."""
    model = HybridModel.from_preset("tiny", seed=4)
    folder = tmp_path / "ours"
    model.save_pretrained(str(folder))
    for name in os.listdir(sharded_folder):
        if name.startswith("model-") or name.endswith(".index.json"):
            os.rename(sharded_folder / name, folder / name)
    assert _same_weights(model, HybridModel.from_pretrained(str(folder), progress=False))
    hf = hf_class(model.config).from_pretrained(str(folder), dtype=torch.float32).eval()
    check_parity(model, hf, model.config, lengths=[5])


def test_a_failed_save_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """The weights file is written under a temporary name: a write that fails half way (a full disk) leaves
    no partial file, and the checkpoint there still loads."""
    import safetensors.torch

    folder = tmp_path / "checkpoint"
    before = HybridModel.from_preset("tiny", seed=1)
    before.save_pretrained(str(folder))
    files = {name: (folder / name).read_bytes() for name in os.listdir(folder)}

    def half_written(tensors, path, metadata=None):
        save_file(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    with pytest.raises(OSError, match="No space left"):
        HybridModel.from_preset("tiny", seed=2).save_pretrained(str(folder))
    monkeypatch.undo()
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == files
    assert _same_weights(before, HybridModel.from_pretrained(str(folder), progress=False))


def test_the_models_own_generation_config_goes_with_it(tmp_path):
    """Loaded from a folder with a generation_config.json: saved elsewhere it is copied along; saved over
    its own folder it stays."""
    source = tmp_path / "source"
    HybridModel.from_preset("tiny").save_pretrained(str(source))
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    model = HybridModel.from_pretrained(str(source), progress=False)
    model.save_pretrained(str(tmp_path / "copy"))
    assert json.loads((tmp_path / "copy" / "generation_config.json").read_text()) == {"eos_token_id": 7}
    model.save_pretrained(str(source))
    assert json.loads((source / "generation_config.json").read_text()) == {"eos_token_id": 7}
    assert sorted(os.listdir(source)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert _same_weights(model, HybridModel.from_pretrained(str(source), progress=False))


def test_other_files_stay_and_a_file_is_no_folder(tmp_path):
    """Files that are no weights of an earlier save (a tokenizer, a README) are left alone; saving into a
    path that is a file is a ValueError."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model-00001-of-00002.txt").write_text("notes")  # not a weights file
    model = HybridModel.from_preset("tiny")
    model.save_pretrained(str(folder))
    assert sorted(os.listdir(folder)) == ["config.json", "model-00001-of-00002.txt", "model.safetensors",
                                         "tokenizer.json"]
    assert set(load_file(folder / "model.safetensors")) >= {"model.embed_tokens.weight", "lm_head.weight"}
    with pytest.raises(ValueError, match="it is a file, not a folder"):
        model.save_pretrained(str(folder / "tokenizer.json"))


def test_saved_files_are_readable_as_any_new_file_of_the_process(tmp_path):
    """safetensors writes its files 0600: a server running as another user (a container) could not read the
    weights of a checkpoint save_pretrained or tools.quantize wrote. They get the mode a new file gets (0666
    less the umask), as config.json does."""
    import stat

    from metrale_graph.tools import quantize

    src, fp8 = tmp_path / "src", tmp_path / "fp8"
    HybridModel.from_preset("tiny").save_pretrained(str(src))
    quantize.quantize_checkpoint(str(src), str(fp8))
    for folder in (src, fp8):
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()}
        assert modes["model.safetensors"] == modes["config.json"], modes
