"""One rank of the two-GPU tensor-parallel check (tests/test_gpu_tp.py launches it with torchrun):
bf16 on the 9B head shapes, a few layers, then an MoE model on the 35B-A3B's with its experts split
across the ranks and within. Rank 0 writes what it measured to $TP_REPORT as JSON."""

import faulthandler
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from metrale_graph import PRESETS, HybridModel, Stream
from metrale_graph.capture import GraphRunner
from metrale_graph.parallel import TensorParallel
from metrale_graph.sharding import MOE_MODES

# 9B head shapes, a small hidden size and 2 layers (1 GDN + 1 attention): quick to compile and capture
CFG = PRESETS["qwen3.5-9b"].replace(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                                    vocab_size=32000, hidden_size=1024, intermediate_size=2048)
# the 35B-A3B's head shapes and expert size, 32 experts top-8, the same two layers
MOE_CFG = PRESETS["qwen3.5-35b-a3b"].replace(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                                             vocab_size=32000, num_experts=32)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def say(what):  # progress on stderr, which the test shows when it fails
    rank = os.environ.get("LOCAL_RANK")
    print(f"[rank {rank} {time.perf_counter() - T0:7.1f} s] {what}", file=sys.stderr, flush=True)


T0 = time.perf_counter()


def check(name, cfg, tp):
    """tp = 2 eager against tp = 1, and replayed against eager with the slots outside the batch untouched,
    on three batches of one bucket grid: the report rows of config `name`."""
    sharded = HybridModel.from_preset(cfg, dtype=torch.bfloat16, device="cuda", seed=3, tp=tp)
    whole = HybridModel.from_preset(cfg, dtype=torch.bfloat16, device="cuda", seed=3)
    g = torch.Generator().manual_seed(0)
    batches = [[Stream(s, torch.randint(0, cfg.vocab_size, (n,), generator=g)) for s, n in ((0, 300), (2, 1), (5, 77))],
               [Stream(s, torch.randint(0, cfg.vocab_size, (n,), generator=g)) for s, n in ((0, 1), (2, 1), (5, 1))],
               [Stream(s, torch.randint(0, cfg.vocab_size, (n,), generator=g)) for s, n in ((5, 200), (1, 64))]]
    caches = {k: m.new_cache(8, 64) for k, m in (("tp1", whole), ("eager", sharded), ("graphs", sharded))}
    runner = GraphRunner(sharded, caches["graphs"], batch_sizes=[2, 4], token_counts=[4, 512])
    say(f"{name}: models and caches built")
    runner.warmup(progress=False, on_bucket=lambda r: say(f"{name} {r.bucket}: compile {r.compile_s:.1f} s"))
    report = []
    for k, batch in enumerate(batches):
        ref = whole.prefill(caches["tp1"], batch)
        eager = sharded.prefill(caches["eager"], batch)
        slots = torch.zeros(9, dtype=torch.bool, device="cuda")
        slots[[s.slot for s in batch]] = True
        before = [t.clone() for t in caches["graphs"].conv_states + caches["graphs"].gdn_states]
        replayed = runner.prefill(batch)
        say(f"{name} batch {k}: tp = 1, tp = 2 eager, replayed")
        untouched = all(torch.equal(t[~slots], old[~slots])
                        for t, old in zip(caches["graphs"].conv_states + caches["graphs"].gdn_states, before))
        report.append({"config": name, "batch": k, "tp2_eager_vs_tp1": rel(eager, ref),
                       "tp2_replay_vs_tp2_eager": rel(replayed, eager), "slots_outside_untouched": untouched})
    return report


def main():
    # a hang prints every thread's stack and ends the process before the test's own timeout
    faulthandler.dump_traceback_later(float(os.environ.get("TP_WORKER_TIMEOUT", "600")), exit=True)
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    tp = TensorParallel.current()
    report = check("dense", CFG, tp)
    for moe in MOE_MODES:  # experts split across the ranks, and each split within
        report += check(f"moe-{moe}", MOE_CFG, replace(tp, moe=moe))
    if tp.rank == 0:
        with open(os.environ["TP_REPORT"], "w") as f:
            json.dump(report, f)
    # no destroy_process_group: with CUDA graphs that captured NCCL calls still alive it waits forever
    # (seen on two H200s, torch 2.11); the process ends and NCCL cleans up at exit


if __name__ == "__main__":
    main()
