"""An OpenAI-compatible HTTP server over the Engine (FastAPI; the `serve` extra).

    from metrale_graph.server import build_app
    app = build_app(engine, model_name="my-model", api_key=None)   # then: uvicorn.run(app, ...)

`python -m metrale_graph.tools.serve` (metrale-serve) loads a model, warms the engine and serves it.
"""

from .app import build_app

__all__ = ["build_app"]
