"""An OpenAI-compatible HTTP server over the Engine (FastAPI; the `serve` extra).

    from metrale_graph.server import build_app
    app = build_app(engine, model_name="my-model", api_key=None)   # then: uvicorn.run(app, ...)

`python -m metrale_graph.tools.serve` (metrale-serve) listens at once (answering with `Loading` while the
model loads), loads the model, warms the engine and serves it.
"""

from .app import build_app, with_cors
from .loading import Loading

__all__ = ["Loading", "build_app", "with_cors"]
