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
    with pytest.raises(ValueError, match=r"random weights in torch.bfloat16 need \d+\.\d GiB of memory and this "
                                         r"machine has \d+\.\d [MG]iB available"):
        HybridModel.from_preset(cfg, dtype=torch.bfloat16)


def test_the_check_reads_what_the_weights_take(checkpoint, monkeypatch):
    """Just below the weights' size the tiny model is refused, from a preset and from a checkpoint; at
    their size it loads (bfloat16 counts half the bytes of float32)."""
    from metrale_graph.spec import weight_bytes, weight_shapes

    need = weight_bytes(weight_shapes(HybridModel.from_preset("tiny").config), torch.float32)
    monkeypatch.setattr(placement, "available_memory", lambda: need - 1)
    with pytest.raises(ValueError, match=r"random weights in torch.float32 need \d\.\d MiB of memory"):
        HybridModel.from_preset("tiny")
    with pytest.raises(ValueError, match=r"the weights of .* in torch.float32 need \d\.\d MiB"):
        HybridModel.from_pretrained(checkpoint, progress=False)
    assert HybridModel.from_preset("tiny", dtype=torch.bfloat16).dtype == torch.bfloat16
    monkeypatch.setattr(placement, "available_memory", lambda: need)
    HybridModel.from_preset("tiny")
    HybridModel.from_pretrained(checkpoint, progress=False)


def test_available_memory_reads_the_machine():
    available = placement.available_memory()
    assert available is None or 0 < available < 2 ** 60
