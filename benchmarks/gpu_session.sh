#!/usr/bin/env bash
# One GPU session in one command (device machines start bare): install the carried
# flash-linear-attention wheels, run the GPU tests and the benchmarks, write logs under $OUT.
#   usage: bash benchmarks/gpu_session.sh [tests|sweep|op-tests|model-tests|ops|decode|bench|profile|moe|moe-tests|moe-decode|small|gdn|gemv|gemv-ab|tp|fp8|fp8-sweep|fp8-bench|w8a16|serve|cookbook|prefix|structured|spec|spec-trace|ahead|all|setup]
#   (run from the repository root)
# tests: every GPU test (sweep + op-tests + model-tests: ~18 min, more than one call); ops: per-op
# benchmark; decode (not in all): bench_ops at decode shapes and benchmarks/kernels/check_decode.py's tile sweep; bench: 9B workloads with the peer and generation; profile (not in all): the 9B workloads' device
# time by phase and top kernels (bench --profile);
# moe: the 35B-A3B and (12 layers) Qwen3-Next-80B-A3B workloads with the peer, the 35B-A3B default-grid warmup;
# gemv (not in all): benchmarks/kernels/check_gemv.py and check_moe_direct.py, the decode GEMVs (dense: cuBLAS against
# ops/gemv.py's one-launch split-K GEMV at its default and other tiles; MoE: the direct path's tiles and forms) at decode
# rows; gemv-ab (not in all): the 9B's and the 35B-A3B's D1 / D32 under METRALE_DECODE_GEMV cublas and triton, tests/test_gemv.py;
# moe-decode (not in all): the MoE decode paths' GPU tests, then the 35B-A3B's D1 / D32 (--profile, --loop 1; MOE_LAYERS),
# and again with METRALE_MOE_SHARED_STREAM=1;
# gdn (not in all): benchmarks/kernels/check_gdn_chunked.py, the GDN chunked forward's config sweep beside fla (issue 42);
# small (not in all): benchmarks/kernels/check_small.py, the decode step's small kernels by form and warp count, and the
# decode-shaped conv's tests on CUDA; moe-tests (not in all): the GPU tests of the MoE decode paths, the direct one (bf16 and FP8, CUDA-graph replay)
# and the counting sort on CUDA tensors (not yet timed); tp: the two-GPU benchmarks
# (9B W2 / W5 against the one-GPU JSON in benchmarks/, 27B W1-W6, 35B-A3B W1 / W2 / W5 with the experts
# split across the ranks and within); fp8 (not in all): the FP8 primitives' check (benchmarks/kernels/check_fp8.py: correctness,
# cuBLAS shapes, graphs), tests/test_gpu_fp8.py, bench_ops on the 9B FP8 preset; fp8-bench (not in all): the FP8
# presets' workloads beside their bf16 runs, the FP8 ops at decode shapes (issue 26; FP8_PRESETS, BF16_35B, FP8_OPS, FP8_NEXT);
# fp8-sweep (not in all): benchmarks/kernels/sweep_fp8_decode.py, the decode-shaped FP8 GEMM's forms and tiles
# (~2-3 min); w8a16 (not in all): the weight-only FP8 decode GEMM (issue 38, item 3: benchmarks/kernels/bench_w8a16.py
# at the 9B's shapes, every tile, its GPU tests, the 9B-FP8's D1 / D32 under METRALE_FP8_DECODE splitk and w8a16; at
# 984b18e w8a16 lost: BENCHMARKS.md, FP8); serve (not in all): metrale-serve + bench_serve at concurrency
# 32 / 128 / 256 on the 9B and 35B-A3B (issue 27; SERVE_PRESETS to choose); cookbook (not in all): SGLang's Qwen3.6 cookbook
# workload through metrale-serve (bench_serve --cookbook, issue 38.4; COOKBOOK_PRESET); prefix (not in all): bench_prefix on the 9B
# (issue 28); structured (not in all): benchmarks/bench_structured.py on the 9B preset, 64 requests with JSON masks
# against without (issue 40; needs xgrammar, apache-tvm-ffi and pydantic (+ pydantic-core, annotated-types,
# typing-inspection, typing-extensions) wheels in .whl-serve and a tokenizer of the 9B's
# vocabulary in .qwen35-tokenizer: python benchmarks/bench_structured.py --make-qwen-tokenizer .qwen35-tokenizer),
# then the structured GPU test; spec-trace (not in all): the one-stream verify's profiler traces read by
# benchmarks/trace_launches.py --gaps (issue 39's host gap); spec (not in all): issue 39's speed item, bench --speculative 1,8,32,128 --echo 1,16 on
# the 9B and the 35B-A3B (SPEC_PRESETS, SPEC_STREAMS, SPEC_KS, SPEC_MTP_K, SPEC_ECHO, SPEC_LAYERS to choose; each
# window's largest kernels and host functions in the JSON; the echo runs last on bigram weights; METRALE_MTP_AFTER=1 in the
# environment times MTP's drafting behind the acceptance): per preset three engines (plain, n-gram with drafts
# forced to k = 1, 2, 3, MTP at k = 2 with a random head), each compiled and captured, the prompts prefilled three
# times; estimated ~3.5-4 min for the 9B and ~4-5 min for the 35B-A3B (slower compiles), ~8-9 min for both (from
# --loop 1,32,128's ~4 min for three engines on the 9B; not yet measured: give each preset its own device call). `setup` only installs (source it
# with `. benchmarks/gpu_session.sh setup` to keep the environment). The device's copy of the tree may carry an older
# .git: export METRALE_COMMIT=<the commit> in the command so the records name the right one.
# Wall times measured on H200s (2026-11-30; plan device time by them, 10 minutes per call at most):
#   test_gpu_sweep -n 8 ~4.5 min; test_gpu_ops ~5.5 min (beside another job); test_gpu_model + capture +
#   engine + moe (both families) 6.2 min; test_gpu_tp ~0.6 min; test_kernels -k gdn_recurrence > 2 min;
#   bench (9B, all workloads, peer, --generate) ~5.5 min; bench 35B-A3B W1-W6 ~1.5 min (on x2; on the
#   one-GPU machine it had not finished W1 after 130 s: give it 5 min); 35B warmup ~2.5 min;
#   bench --tp 2 9B W2,W5 ~1.5 min; bench --tp 2 27B W1-W6 ~2.5 min. On `nvidia-h200-x2` two one-GPU
#   steps can run side by side (CUDA_VISIBLE_DEVICES=0 / 1).
# Measured 2026-12-01 (fourth session): bench 9B --repeat 3 --generate had reached D128 after 370 s (every variant:
#   run W1-D32 and D128 + --generate as two commands); serve (9B, 256 slots, 68 buckets in 68 s) with c32 / c128 /
#   c256 / 8 req/s ~4 min; check_decode ~1 min; bench --profile D128,W7,D1 graphs ~1.5 min; bench 35B-A3B W1-W6
#   graphs ~1.5 min; test_gpu_moe ~3 min; test_gpu_fp8 1.6 min; test_gpu_prefix did not finish in 290 s beside two
#   other test processes (give it a call of its own). `timeout -s INT` does not stop pytest while Inductor
#   compiles (ptxas dies, the compile goes on): keep each step's limit well inside the call's. A call returns at
#   most 8 files from $OUT: the sections write few.
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/metrale_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
# the package itself, editable (metrale_graph.ops / .capture / .tools map to the top-level folders)
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 FLA_DISABLE_TENSOR_CACHE=1 NCCL_NVLS_ENABLE=0
[[ $what == setup ]] && return 0 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
git log -1 --format='commit %H' 2>/dev/null | tee -a "$OUT/gpu.txt"
status=0
# `tests` is three parts, each under one device call of 10 minutes: sweep, op-tests, model-tests. STEP_LIMIT
# (seconds) stops a part with SIGINT, so pytest still prints which tests failed and why.
runs() { [[ $what == "$1" || $what == tests || $what == all ]]; }
limit() { if [[ -n ${STEP_LIMIT:-} ]]; then timeout -k 10 -s INT "$STEP_LIMIT" "$@"; else "$@"; fi; }
if runs sweep; then
    # the config sweep compiles one step per config: in parallel processes
    METRALE_REPORT="$OUT/gpu_sweep.jsonl" limit python3 -m pytest -q -rfE -p no:cacheprovider -n 8 \
        tests/test_gpu_sweep.py 2>&1 | tee "$OUT/gpu_sweep.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -20
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if runs op-tests; then
    # test_kernels on the GPU: the recurrence only (its chunked kernels compiled, not interpreted; fla);
    # the other kernels' 560 cases run in the CPU suite through Triton's interpreter (on a GPU: ~25 min)
    limit python3 -m pytest -q -rfE -s -p no:cacheprovider tests/test_gpu_ops.py tests/test_kernels.py \
        -k "not test_kernels or gdn_recurrence" 2>&1 | tee "$OUT/gpu_op_tests.log" \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -30
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if runs model-tests; then
    limit python3 -m pytest -q -rfE -s -p no:cacheprovider tests/test_gpu_model.py tests/test_gpu_capture.py \
        tests/test_gpu_engine.py tests/test_gpu_moe.py tests/test_gpu_tp.py ${GPU_TESTS_EXTRA:-} 2>&1 \
        | tee "$OUT/gpu_model_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed|vs fp32|after 1000|compile [0-9]" \
        | tail -60
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == ops || $what == all ]]; then
    python3 benchmarks/kernels/bench_ops.py --markdown "$OUT/bench_ops.md" 2>&1 | tee "$OUT/bench_ops.log" | tail -20
fi
if [[ $what == bench || $what == all ]]; then
    python3 -m metrale_graph.tools.bench --preset tiny --repeat 3 2>&1 | tee "$OUT/bench_tiny.log" | tail -12
    python3 -m metrale_graph.tools.bench --repeat 7 --generate --json "$OUT/bench.json" --markdown "$OUT/bench.md" \
        2>&1 | tee "$OUT/bench.log" | tail -18
fi
if [[ $what == decode ]]; then
    # issue 24's decode targets: every op at D1 / D32 / D128 shapes against its floor, then the sweep of the two
    # state-bound kernels' tiles (the GDN recurrence's BV / warps, paged decode's split count)
    python3 benchmarks/kernels/bench_ops.py --decode 1,32,128 --markdown "$OUT/bench_ops-decode.md" 2>&1 \
        | tee "$OUT/bench_ops-decode.log" | tail -32
    python3 benchmarks/kernels/check_decode.py --json "$OUT/check_decode.json" 2>&1 | tee "$OUT/check_decode.log" \
        | tail -45
    # paged decode in a server's block tables (32768 keys a stream): each stream's split against the static one
    python3 benchmarks/kernels/check_decode.py --streams 1,32 --table-keys 32768 --short 16 \
        --json "$OUT/check_decode-table32k.json" 2>&1 | grep -E "paged|floor" | tee "$OUT/check_decode-table32k.log"
fi
if [[ $what == profile ]]; then
    python3 -m metrale_graph.tools.bench --workloads W2,W4,W5,W7,D1,D32,D128 --variants compiled,graphs --repeat 5 \
        --profile --host-profile --json "$OUT/bench-profile.json" 2>&1 | tee "$OUT/bench-profile.log" | tail -160
fi
if [[ $what == moe || $what == all ]]; then
    python3 -m metrale_graph.tools.bench --preset qwen3.5-35b-a3b --workloads W1,W2,W3,W4,W5,W6 --repeat 5 \
        --json "$OUT/bench-35b.json" --markdown "$OUT/bench-35b.md" 2>&1 | tee "$OUT/bench-35b.log" | tail -10
    # Qwen3-Next-80B-A3B is 160 GB in bf16: a quarter of its layers (12 of 48) on one GPU
    python3 -m metrale_graph.tools.bench --preset qwen3-next-80b-a3b --layers 12 --workloads W1,W2,W3,W4,W5,W6 \
        --repeat 5 --json "$OUT/bench-next-12l.json" --markdown "$OUT/bench-next-12l.md" 2>&1 \
        | tee "$OUT/bench-next-12l.log" | tail -10
    python3 -m metrale_graph.tools.warmup --model qwen3.5-35b-a3b --no-progress --cache-dir /tmp/metrale_cache \
        2>&1 | tee "$OUT/warmup-35b.log" | tail -3
fi
if [[ $what == tp || $what == all ]] && (( $(nvidia-smi -L | wc -l) >= 2 )); then
    python3 -m torch.distributed.run --nproc-per-node 2 -m metrale_graph.tools.bench --tp 2 --workloads W2,W5 \
        --variants graphs --repeat 7 --baseline benchmarks/h200-qwen3.5-9b.json --json "$OUT/bench-9b-tp2.json" \
        2>&1 | tee "$OUT/bench-9b-tp2.log" | tail -6
    python3 -m torch.distributed.run --nproc-per-node 2 -m metrale_graph.tools.bench --tp 2 --preset qwen3.5-27b \
        --workloads W1,W2,W3,W4,W5,W6 --variants graphs --repeat 5 --json "$OUT/bench-27b-tp2.json" \
        2>&1 | tee "$OUT/bench-27b-tp2.log" | tail -10
    # MoE under tensor parallelism: the 35B-A3B's experts split across the two ranks, then each split within
    for mode in expert within; do
        python3 -m torch.distributed.run --nproc-per-node 2 -m metrale_graph.tools.bench --tp 2 --preset qwen3.5-35b-a3b \
            --moe-parallel $mode --workloads W1,W2,W5 --variants graphs --repeat 5 \
            --baseline benchmarks/h200-qwen3.5-35b-a3b.json --json "$OUT/bench-35b-tp2-$mode.json" 2>&1 \
            | tee "$OUT/bench-35b-tp2-$mode.log" | tail -6
    done
fi
if [[ $what == fp8 ]]; then
    limit python3 benchmarks/kernels/check_fp8.py --sections correctness,cublas,perf,graphs --json "$OUT/fp8.json" \
        2>"$OUT/fp8.err" | tee "$OUT/fp8.log" | tail -40
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    limit python3 -m pytest -q -rfE -s -p no:cacheprovider tests/test_gpu_fp8.py 2>&1 | tee "$OUT/gpu_fp8_tests.log" \
        | grep -E "^(FAILED|ERROR)|passed|failed|graphs vs eager" | tail -30
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    python3 benchmarks/kernels/bench_ops.py --preset qwen3.5-9b-fp8 --markdown "$OUT/bench_ops-fp8.md" 2>&1 \
        | tee "$OUT/bench_ops-fp8.log" | tail -14
fi
serve_wheels() {  # fastapi / uvicorn / pydantic ... from .whl-serve, only those the device lacks
    if [[ -d .whl-serve ]]; then
        local missing=() w n
        for w in .whl-serve/*.whl; do
            n=$(basename "$w" | cut -d- -f1); [[ $n == opentelemetry_api ]] && n=opentelemetry
            python3 -c "import $n" 2>/dev/null || missing+=("$w")
        done
        (( ${#missing[@]} )) && python3 -m pip install -q --no-index --no-deps --target /tmp/site-serve "${missing[@]}"
        export PYTHONPATH=$PYTHONPATH:/tmp/site-serve
    fi
}
get() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('$1').read().decode())"; }
serve_start() {  # log file, then metrale-serve's flags (port 8011): returns once /health answers or the server exits
    local log=$1; shift
    python3 -m metrale_graph.tools.serve --port 8011 "$@" > "$log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
        get http://127.0.0.1:8011/health >/dev/null 2>&1 && break
        kill -0 $server 2>/dev/null || break  # it exited (its log says why)
        sleep 1
    done
    grep -E "warmup|serving" "$log" | tail -2
}
serve_stop() { kill -TERM $server; wait $server; tail -3 "$1"; }
if [[ $what == serve ]]; then
    # issue 27: metrale-serve on a preset, bench_serve at concurrency 32 / 128 / 256 (512 in, 256 out); the
    # server warms its bucket grid (decode buckets up to the slots) before /health says 200. The device machine
    # has no fastapi / uvicorn / pydantic: carry their wheels in .whl-serve (pip download fastapi uvicorn
    # prometheus_client --python-version 3.12 --only-binary=:all: -d .whl-serve); only what is missing installs
    serve_wheels
    # a device call returns at most 8 files: per preset the server's log, the clients' log and one JSON of every run
    runs=/tmp/serve-runs; rm -rf $runs; mkdir -p $runs
    for preset in ${SERVE_PRESETS:-qwen3.5-9b qwen3.5-35b-a3b}; do
        dir=$runs/$preset; mkdir -p "$dir"  # (a folder per preset: qwen3.5-9b's files are not qwen3.5-9b-fp8's)
        server_args="--model $preset --port 8011 --num-slots 256 --max-context 1024 --token-budget 4096"
        serve_start "$OUT/serve-$preset.log" $server_args
        bench() {  # name, then bench_serve's load flags
            local name=$1; shift
            python3 -m metrale_graph.tools.bench_serve --base-url http://127.0.0.1:8011 --input-len 512 --output-len 256 \
                "$@" --json "$dir/$name.json" 2>&1 | tee -a "$OUT/bench_serve-$preset.log" | tail -12
        }
        for c in 32 128 256; do bench c$c --num-prompts $((c * 2)) --max-concurrency $c; done
        # issue 27's TTFT target is at a request rate the server sustains (Poisson arrivals, not waves of 128; the
        # 9B saturates near 20 req/s)
        for rate in ${SERVE_RATES:-8 16}; do bench r$rate --num-prompts 256 --request-rate $rate --max-concurrency 128; done
        get http://127.0.0.1:8011/metrics > "$dir/metrics.txt"
        serve_stop "$OUT/serve-$preset.log"
        python3 - "$dir" "python -m metrale_graph.tools.serve $server_args" "$OUT/bench_serve-$preset.json" <<'PY'
import glob, json, os, sys
runs, command, out = sys.argv[1:]
record = {"server_command": command, "runs": {}}
for f in sorted(glob.glob(os.path.join(runs, "*.json"))):
    record["runs"][os.path.basename(f)[:-5]] = json.load(open(f))
metrics = os.path.join(runs, "metrics.txt")
if os.path.exists(metrics):
    record["metrics"] = open(metrics).read()
json.dump(record, open(out, "w"), indent=1)
PY
    done
fi
if [[ $what == cookbook ]]; then
    # issue 38.4: SGLang's Qwen3.6 cookbook workload (8192 in / 1024 out at concurrency 1, 16, 64) on metrale-serve,
    # its TPOT beside SGLang's published one-H200 figures (bench_serve --cookbook); one preset a call (the 35B-A3B's
    # warm-up takes minutes): COOKBOOK_PRESET (default qwen3.5-35b-a3b; qwen3.5-35b-a3b-fp8 for the FP8 column)
    serve_wheels
    preset=${COOKBOOK_PRESET:-qwen3.5-35b-a3b}
    serve_start "$OUT/serve-cookbook-$preset.log" --model $preset --num-slots 64 --max-context 9472 --token-budget 8192
    python3 -m metrale_graph.tools.bench_serve --base-url http://127.0.0.1:8011 --cookbook \
        --json "$OUT/cookbook-$preset.json" 2>&1 | tee "$OUT/cookbook-$preset.log" | tail -12
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    serve_stop "$OUT/serve-cookbook-$preset.log"
fi
if [[ $what == structured ]]; then
    if [[ -d .whl-serve ]]; then  # (xgrammar, apache-tvm-ffi, pydantic and its four: what the device lacks)
        python3 -m pip install -q --no-index --no-deps --target /tmp/site-serve .whl-serve/*.whl
        export PYTHONPATH=$PYTHONPATH:/tmp/site-serve
    fi
    limit python3 benchmarks/bench_structured.py --model ${STRUCTURED_MODEL:-qwen3.5-9b} \
        --tokenizer ${STRUCTURED_TOKENIZER:-.qwen35-tokenizer} 2>&1 | tee "$OUT/bench_structured-9b.log" | tail -6
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    python3 benchmarks/bench_structured.py --masks-only --tokenizer ${STRUCTURED_TOKENIZER:-.qwen35-tokenizer} \
        2>&1 | tee -a "$OUT/bench_structured-9b.log" | tail -6
    limit python3 -m pytest -q -rfE -p no:cacheprovider tests/test_structured.py -k gpu 2>&1 | tail -3
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == spec ]]; then
    # issue 39: the verify step against the plain decode step, the MTP draft's cost, the n-gram echo workload and the
    # projection at vLLM's published acceptance (tools/bench_speculative.py; docs/benchmarking.md)
    for preset in ${SPEC_PRESETS:-qwen3.5-9b qwen3.5-35b-a3b}; do
        # --host-profile: each window's engine-loop functions (host_top in the JSON; the sync verify step's host gap)
        limit python3 -m metrale_graph.tools.bench --preset $preset --speculative ${SPEC_STREAMS:-1,8,32,128} \
            --speculative-k ${SPEC_KS:-1,2,3} --speculative-mtp-k ${SPEC_MTP_K:-2} --echo ${SPEC_ECHO:-1,16} \
            ${SPEC_LAYERS:+--layers $SPEC_LAYERS} --host-profile --json "$OUT/bench-spec-$preset.json" 2>&1 \
            | tee "$OUT/bench-spec-$preset.log" | grep -v "^{" | tail -60
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done
fi
if [[ $what == ahead ]]; then
    # issue 38's asynchronous verify: benchmarks/check_verify_ahead.py, one engine per preset (AHEAD_PRESETS), plain /
    # synchronous MTP / drafting behind the acceptance / verify ahead at AHEAD_STREAMS streams (~3 min a preset)
    for preset in ${AHEAD_PRESETS:-qwen3.5-9b}; do
        limit python3 benchmarks/check_verify_ahead.py --preset $preset --streams ${AHEAD_STREAMS:-1,8} --k 2 \
            --json "$OUT/ahead-$preset.json" 2>&1 | grep -v Warning | tee "$OUT/ahead-$preset.log" | tail -12
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done
fi
if [[ $what == spec-trace ]]; then
    # issue 39's verify host gap: one stream, k 3 drafts, the profiler traces of the plain and verify windows, then
    # benchmarks/trace_launches.py: each graph's launch, the idle inside it (between its kernels) and the device's
    # idle stretches with the host's runtime calls in them (SPEC_PRESETS; ~3 min a preset)
    for preset in ${SPEC_PRESETS:-qwen3.5-9b}; do
        limit python3 -m metrale_graph.tools.bench --preset $preset --speculative 1 --speculative-k 3 --speculative-mtp-k 0 \
            --host-profile --trace /tmp/traces-$preset --json "$OUT/bench-spec-trace-$preset.json" 2>&1 \
            | tee "$OUT/bench-spec-trace-$preset.log" | grep -v "^{" | tail -12
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
        python3 benchmarks/trace_launches.py /tmp/traces-$preset/*.json.gz --gaps 15 --json "$OUT/launches-$preset.json" \
            | grep -v "^{" | tee "$OUT/launches-$preset.log"
    done
fi
if [[ $what == prefix ]]; then
    # issue 28: the prefix cache's workloads on the 9B, with the cache and without, CUDA graphs
    python3 -m metrale_graph.tools.bench_prefix --model qwen3.5-9b --json "$OUT/bench_prefix-9b.json" 2>&1 \
        | tee "$OUT/bench_prefix-9b.log" | tail -16
fi
if [[ $what == fp8-sweep ]]; then
    # issue 26's decode GEMM: every candidate form and tile of the FP8 GEMM at 1 / 4 / 16 / 32 rows (~2-3 min)
    limit python3 benchmarks/kernels/sweep_fp8_decode.py --json "$OUT/sweep_fp8_decode.json" 2>&1 \
        | grep -v Warning | tee "$OUT/sweep_fp8_decode.log" | tail -20
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == w8a16 ]]; then
    limit python3 benchmarks/kernels/bench_w8a16.py --sweep --json "$OUT/bench_w8a16.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench_w8a16.log" | grep -v "^ " | tail -14
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    limit python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_fp8_w8a16.py 2>&1 | tail -5
    for form in splitk w8a16; do
        METRALE_FP8_DECODE=$form limit python3 -m metrale_graph.tools.bench --preset qwen3.5-9b-fp8 --workloads D1,D32 \
            --variants graphs --repeat 5 --json "$OUT/bench-9b-fp8-decode-$form.json" 2>&1 \
            | tee -a "$OUT/bench-w8a16.log" | grep -E "^ *D(1|32) |Error"
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done
fi
if [[ $what == gemv ]]; then
    # issue 38's decode GEMVs: benchmarks/kernels/check_gemv.py (the 9B's and the 35B-A3B's dense projections at 1 / 4 /
    # 16 rows, cuBLAS against an experimental one-launch split-K Triton GEMV, ~2-3 min), then check_moe_direct.py (the
    # MoE direct path's kernels at every tile, its experimental gate|up forms, cuBLAS bmm and a plain read, ~1-2 min)
    limit python3 benchmarks/kernels/check_gemv.py --rows ${GEMV_ROWS:-1,4,16} --json "$OUT/gemv.json" 2>&1 | grep -v Warning \
        | tee "$OUT/gemv.log" | grep -v "^{" | tail -50
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    limit python3 benchmarks/kernels/check_moe_direct.py --tokens 1,4 --json "$OUT/moe_direct.json" 2>&1 \
        | grep -v Warning | tee "$OUT/moe_direct.log" | grep -v "^{" | tail -80
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == gemv-ab ]]; then
    # issue 38: ops/gemv.py's one-launch GEMV against cuBLAS in the whole decode step (METRALE_DECODE_GEMV), D1 / D32
    # graphs per preset (GEMV_PRESETS, default the 9B and the 35B-A3B; ~1.5 min a run), then its GPU tests
    for preset in ${GEMV_PRESETS:-qwen3.5-9b qwen3.5-35b-a3b}; do
        for backend in cublas triton; do
            METRALE_DECODE_GEMV=$backend limit python3 -m metrale_graph.tools.bench --preset $preset --workloads D1,D32 \
                --variants graphs --repeat 5 --json "$OUT/bench-$preset-gemv-$backend.json" 2>&1 \
                | tee -a "$OUT/bench-gemv-ab.log" | grep -E "^ *D(1|32) |Error"
            [[ ${PIPESTATUS[0]} == 0 ]] || status=1
        done
    done
    limit python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gemv.py 2>&1 | tee "$OUT/gemv_tests.log" \
        | grep -E "^(FAILED|ERROR)|passed|failed"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == moe-tests ]]; then
    # the MoE decode paths the 820b41b A/B made the only ones (BENCHMARKS.md, MoE): the direct path's GPU tests
    # (35B-A3B layer shape, bf16 and FP8, graph replay) and the counting sort's (CUDA tensors, align_pairs, a graph)
    limit python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_moe_direct.py tests/test_kernels.py \
        -k "direct or count_sort" 2>&1 | tee "$OUT/moe_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == moe-decode ]]; then
    # issue 38: the MoE decode step with padding rows skipped (f446ff8): the GPU tests of the direct and aligned paths
    # (route, direct, count sort), then the 35B-A3B's D1 / D32 with --profile (MOE_LAYERS layers, default 20: fits an
    # H100; 40 on an H200) and --loop 1 (~3 min)
    limit python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_moe_direct.py tests/test_kernels.py \
        -k "direct or count_sort or route or shared_expert_stream" 2>&1 | tee "$OUT/moe_tests.log" \
        | grep -E "^(FAILED|ERROR)|passed|failed"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    limit python3 -m metrale_graph.tools.bench --preset qwen3.5-35b-a3b --layers ${MOE_LAYERS:-20} --workloads D1,D32 \
        --variants graphs --repeat 3 --profile --loop 1 --json "$OUT/bench-35b-moe-decode.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench-35b-moe-decode.log" | grep -E "^ *D(1|32) |^ *1 |Error"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    # the shared expert on a second stream (METRALE_MOE_SHARED_STREAM, opt-in): the same D1 / D32 beside the above
    METRALE_MOE_SHARED_STREAM=1 limit python3 -m metrale_graph.tools.bench --preset qwen3.5-35b-a3b \
        --layers ${MOE_LAYERS:-20} --workloads D1,D32 --variants graphs --repeat 3 --profile \
        --json "$OUT/bench-35b-moe-decode-shared-stream.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench-35b-moe-decode-shared-stream.log" | grep -E "^ *D(1|32) |Error"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == gdn ]]; then
    # issue 42: the GDN chunked forward per layer at the 9B's heads, every config of the sweep (one and two value
    # heads a state-pass program) beside fla, the default's device time by kernel (intra / state pass)
    limit python3 benchmarks/kernels/check_gdn_chunked.py --json "$OUT/gdn_chunked.json" 2>&1 | grep -v '^{' \
        | tee "$OUT/gdn_chunked.log" | tail -60
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == small ]]; then
    # issue 38: the decode step's small kernels by form and warp count (benchmarks/kernels/check_small.py) on the
    # 35B-A3B's and the 9B's one-stream bucket, then the decode-shaped conv's tests on CUDA (~1 min)
    for preset in ${SMALL_PRESETS:-qwen3.5-35b-a3b qwen3.5-9b}; do
        limit python3 benchmarks/kernels/check_small.py --preset $preset --json "$OUT/small-$preset.json" 2>&1 \
            | grep -v '^{' | tee -a "$OUT/small.log"
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done
    limit python3 -m pytest -q -rfE -p no:cacheprovider tests/test_kernels.py -k "conv" 2>&1 \
        | tee "$OUT/small_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == fp8-bench ]]; then
    # issue 26: one bench run of each FP8 preset (W1-W7, D1, D32; FP8_PRESETS to choose, e.g. one per device call on a
    # fresh machine), the 35B-A3B's bf16 workloads its FP8 run is compared with that no other run measured (BF16_35B:
    # W3,W7,D1,D32; empty to skip), the FP8 ops against their floor (bench_ops, FP8_OPS=0 to skip). FP8_NEXT=1 adds
    # Qwen3-Next-80B-A3B-FP8, all 48 layers (~4.5 min; measured at 9e87066). No --markdown: a call returns at most 8
    # files, and the JSON holds every figure
    for preset in ${FP8_PRESETS:-qwen3.5-9b-fp8 qwen3.5-35b-a3b-fp8}; do
        limit python3 -m metrale_graph.tools.bench --preset $preset --workloads W1,W2,W3,W4,W5,W6,W7,D1,D32 \
            --variants graphs --repeat 3 --json "$OUT/bench-$preset.json" 2>&1 | tee "$OUT/bench-$preset.log" | tail -12
    done
    if [[ -n ${BF16_35B-W3,W7,D1,D32} ]]; then
        limit python3 -m metrale_graph.tools.bench --preset qwen3.5-35b-a3b --workloads ${BF16_35B-W3,W7,D1,D32} \
            --variants graphs --repeat 3 --json "$OUT/bench-qwen3.5-35b-a3b-bf16.json" 2>&1 | tail -7
    fi
    if [[ ${FP8_OPS:-1} == 1 ]]; then
        limit python3 benchmarks/kernels/bench_ops.py --preset qwen3.5-9b-fp8 --decode 1,32 2>&1 \
            | tee "$OUT/bench_ops-fp8.log" | tail -24
    fi
    if [[ ${FP8_NEXT:-0} == 1 ]]; then
        limit python3 -m metrale_graph.tools.bench --preset qwen3-next-80b-a3b-fp8 --workloads W1,W2,W3,W4,W5,W6,D1,D32 \
            --variants graphs --repeat 3 --generate --json "$OUT/bench-next-fp8.json" 2>&1 \
            | tee "$OUT/bench-next-fp8.log" | tail -12
    fi
fi
exit $status
