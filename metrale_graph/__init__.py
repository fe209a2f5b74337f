"""metrale-graph: the batched prefill of Qwen3.5-style hybrid models as one compiled graph.

Public API::

    from metrale_graph import HybridModel, Stream
    model = HybridModel.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    cache = model.new_cache(num_slots=64, num_blocks=4096)
    logits = model.prefill(cache, [Stream(slot=0, tokens=[...]), Stream(slot=5, tokens=[...])])

    from metrale_graph import Engine
    engine = Engine(model, num_slots=64)
    results = engine.generate(prompts, max_new_tokens=128)
    handle = engine.submit(prompt, max_new_tokens=128)   # online: any time, any thread; iterate or abort it
"""

from .config import ModelConfig, PRESETS, load_config
from .batch import Stream
from .cache import HybridCache
from .model import HybridModel
from .engine import (Engine, EngineClosedError, EngineFullError, GenerationResult, RequestHandle, RequestOutput,
                     TokenEvent)

__all__ = ["HybridModel", "HybridCache", "ModelConfig", "PRESETS", "Stream", "load_config", "Engine",
           "EngineClosedError", "EngineFullError", "GenerationResult", "RequestHandle", "RequestOutput", "TokenEvent"]
