"""metrale-graph: the batched prefill of Qwen3.5-style hybrid models as one compiled graph.

Public API::

    from metrale_graph import HybridModel, Stream
    model = HybridModel.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    cache = model.new_cache(num_slots=64, num_blocks=4096)
    logits = model.prefill(cache, [Stream(slot=0, tokens=[...]), Stream(slot=5, tokens=[...])])

    from metrale_graph import Engine
    results = Engine(model, num_slots=64).generate(prompts, max_new_tokens=128)
"""

import os as _os

# The phase ops live in the top-level folder ops/ and the capture code in capture/; an
# install maps them to metrale_graph.ops / metrale_graph.capture. Run straight from a
# source checkout (PYTHONPATH=repo, no install), the same names resolve through the
# checkout's root, which holds those folders.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "ops")) and _os.path.isfile(
    _os.path.join(_root, "ops", "__init__.py")
):
    __path__.append(_root)  # noqa: F821 (package __path__)

from .config import ModelConfig, PRESETS, load_config  # noqa: E402
from .batch import Stream  # noqa: E402
from .cache import HybridCache  # noqa: E402
from .model import HybridModel  # noqa: E402
from .engine import Engine, GenerationResult, TokenEvent  # noqa: E402

__all__ = ["HybridModel", "HybridCache", "ModelConfig", "PRESETS", "Stream", "load_config", "Engine",
           "GenerationResult", "TokenEvent"]
