"""export_prefill bad arguments: B > T, zero, negative, bool, float."""
import sys
sys.path.insert(0, "/work/probe_misc")
from onnx_harness import *
model = build(tiny_config())
cache = model.new_cache(4, 20, block_size=16, max_context=64)
for B, T in [(5, 3), (0, 4), (2, 0), (-1, 4), (2, -3), (True, 4), (2.0, 4), (4, 2)]:
    try:
        t0 = time.time()
        p = export_prefill(model, cache, B, T)
        print(B, T, "-> EXPORTED (no error)", f"{time.time()-t0:.1f}s")
    except Exception as e:
        print(B, T, "->", type(e).__name__, str(e)[:200])
