"""Dtypes as users pass them, devices torch cannot use, and the host memory a CPU model needs, checked
before it is allocated."""

import pytest
import torch

from helpers import tiny_config
from metrale_graph import HybridModel
from metrale_graph import placement


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    HybridModel.from_preset("tiny").save_pretrained(str(folder))
    return str(folder)


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("float32", torch.float32),
                                         ("torch.float16", torch.float16), ("half", torch.float16)])
def test_dtype_by_name(checkpoint, name, dtype):
    assert HybridModel.from_preset("tiny", dtype=name).dtype == dtype
    assert HybridModel.from_pretrained(checkpoint, dtype=name, progress=False).dtype == dtype


@pytest.mark.parametrize("bad", ["int8", "float64", "bf16", "torch.bfloat"])
def test_unknown_dtype_name_names_the_choices(checkpoint, bad):
    for load in (lambda: HybridModel.from_preset("tiny", dtype=bad),
                 lambda: HybridModel.from_pretrained(checkpoint, dtype=bad, progress=False)):
        with pytest.raises(ValueError, match=f"unsupported dtype '{bad}'; use one of 'float32', 'bfloat16', "
                                             "'float16'"):
            load()


def test_a_cuda_device_torch_cannot_use_is_a_value_error(checkpoint):
    """`device="cuda"` without a GPU raised torch's AssertionError / RuntimeError from deep inside."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [f"cuda:{count}"] + ([] if count else ["cuda"])
    for device in devices:
        expected = "torch sees no CUDA GPU" if not count else f"torch sees {count} CUDA GPU"
        with pytest.raises(ValueError, match=f"device '{device}' is not available: {expected}"):
            HybridModel.from_preset("tiny", device=device)
        with pytest.raises(ValueError, match=f"device '{device}' is not available: {expected}"):
            HybridModel.from_pretrained(checkpoint, device=device, progress=False)
    with pytest.raises(ValueError, match="invalid device 'gpu'"):
        HybridModel.from_preset("tiny", device="gpu")


def test_weights_beyond_the_memory_available_are_refused_before_allocating():
    """A vocabulary of 10**12 rows: about 175 TiB of embeddings and LM head in bfloat16, refused with the figures before
    anything is allocated (torch would refuse too, with its own RuntimeError; a model within a few times
    the machine's memory was killed by the kernel without a message)."""
    cfg = tiny_config(vocab_size=10 ** 12)
    with pytest.raises(ValueError, match=r"random weights in torch.bfloat16 need 174\.6 TiB of memory and this "
                                         r"machine has \d+\.\d [MGT]iB available"):
        HybridModel.from_preset(cfg, dtype=torch.bfloat16)


def test_the_check_reads_what_the_weights_take(checkpoint, monkeypatch):
    """Just below the weights' size the tiny model is refused, from a preset and from a checkpoint; at
    their size it loads (bfloat16 counts half the bytes of float32)."""
    from metrale_graph.spec import weight_bytes, weight_shapes

    need = weight_bytes(weight_shapes(HybridModel.from_preset("tiny").config), torch.float32)
    monkeypatch.setattr(placement, "available_memory", lambda: need - 1)
    with pytest.raises(ValueError, match=r"random weights in torch.float32 need \d+\.\d [KM]iB of memory"):
        HybridModel.from_preset("tiny")
    with pytest.raises(ValueError, match=r"the weights of .* in torch.float32 need \d+\.\d [KM]iB"):
        HybridModel.from_pretrained(checkpoint, progress=False)
    assert HybridModel.from_preset("tiny", dtype=torch.bfloat16).dtype == torch.bfloat16
    monkeypatch.setattr(placement, "available_memory", lambda: need)
    HybridModel.from_preset("tiny")
    HybridModel.from_pretrained(checkpoint, progress=False)


def test_available_memory_reads_the_machine():
    available = placement.available_memory()
    assert available is None or 0 < available < 2 ** 60


def test_a_cache_is_checked_against_the_memory_free_before_it_is_allocated(monkeypatch):
    """The cache's pools ask for exactly what it allocates: just below, refused naming each argument's share;
    at it, built. (A prefix_checkpoints of 10**12 was the allocator's RuntimeError.)"""
    from metrale_graph.batch import PackedBatch
    from metrale_graph.cache_sizes import pool_asks

    model = HybridModel.from_preset("tiny")
    cache = model.new_cache(3, 10, block_size=16, max_context=100, prefix_checkpoints=4)
    pools = (cache.conv_states + cache.gdn_states + cache.k_caches + cache.v_caches + [cache.block_tables]
             + cache.checkpoint_conv_states + cache.checkpoint_gdn_states)
    need = sum(n for _, n in pool_asks(model.config, 3, 10, 16, 100, model.dtype, 4))
    assert need == sum(t.numel() * t.element_size() for t in pools)
    padding = PackedBatch.padding(3, 37, cache)
    assert PackedBatch.padding_bytes(3, 37, cache) == sum(t.numel() * t.element_size() for t in (
        padding.tokens, padding.positions, padding.cu_seqlens, padding.slot_ids, padding.context_lens,
        padding.block_tables))
    monkeypatch.setattr(placement, "available_memory", lambda: need - 1)
    with pytest.raises(ValueError, match=r"the cache's pools need \d+\.\d KiB of memory and cpu has \d+\.\d KiB free "
                                         r"of \d+\.\d [GT]iB: ") as refused:
        model.new_cache(3, 10, block_size=16, max_context=100, prefix_checkpoints=4)
    for part in ("KV blocks (num_blocks=10 of block_size=16)", "GDN state checkpoints (prefix_checkpoints=4)",
                 "slot states (num_slots=3)"):
        assert part in str(refused.value)
    monkeypatch.setattr(placement, "available_memory", lambda: need)
    model.new_cache(3, 10, block_size=16, max_context=100, prefix_checkpoints=4)


def test_cuda_memory_free_counts_what_the_caching_allocator_holds_unused(monkeypatch):
    """On CUDA a new allocation may take the device's free memory and the blocks torch's caching allocator
    reserved but does not use (the CUDA calls stubbed: this runs without a GPU)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2 ** 30, 140 * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * 2 ** 30)
    assert placement.device_memory(torch.device("cuda:0")) == (4 * 2 ** 30, 140 * 2 ** 30)
    placement.check_memory([("slot states (num_slots=8)", 4 * 2 ** 30)], "cuda:0", "the cache's pools")
    with pytest.raises(ValueError, match=r"the cache's pools need 4\.0 GiB of memory and cuda:0 has 4\.0 GiB free of "
                                         r"140\.0 GiB: slot states \(num_slots=8\) 4\.0 GiB"):
        placement.check_memory([("slot states (num_slots=8)", 4 * 2 ** 30 + 1)], "cuda:0", "the cache's pools")
