"""metrale-graph: the batched prefill of Qwen3.5-style hybrid models as one compiled graph.

Public API::

    from metrale_graph import HybridModel, Stream
    model = HybridModel.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    cache = model.new_cache(num_slots=64, num_blocks=4096)
    logits = model.prefill(cache, [Stream(slot=0, tokens=[...]), Stream(slot=5, tokens=[...])])

    from metrale_graph import Engine
    results = Engine(model, num_slots=64).generate(prompts, max_new_tokens=128)
"""

from .config import ModelConfig, PRESETS, load_config
from .batch import Stream
from .cache import HybridCache
from .model import HybridModel
from .engine import Engine, GenerationResult, TokenEvent

__all__ = ["HybridModel", "HybridCache", "ModelConfig", "PRESETS", "Stream", "load_config", "Engine",
           "GenerationResult", "TokenEvent"]
