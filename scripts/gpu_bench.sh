#!/usr/bin/env bash
# The GPU measurement plan of docs/benchmarks.md, run on the lent H200 from the repo root:
#
#   bash scripts/gpu_bench.sh STAGE...
#
# stages: tests tests-quick tests-ssd tests-attention check prefill decode decode-eager hf ab serve load load-sweep load-profile trace profile-mixed kernels attention profile ncu audit moe moe-presets overlap fp8 prefill-graphs suffix families families-hf
#         latency targets head-start latency-profile attention-decode prefix-attention gemv
#         gemv-rules
#         decode-kernels fp8-serve
#         fp8-sweep fp8-rows fp8-state pdl prefetch dense-attn host sampler
#         tp (nvidia-h200-x2: TP_SIZE ranks)
# Everything printed goes to $OUT/log.txt; each stage's JSON / PNG files are packed into
# $OUT/results.tgz (the device tool returns at most 8 files). Each stage has its own time limit
# (STAGE_TIMEOUT_<stage> seconds overrides it) so one failure or hang leaves the others.
# Server wheels (fastapi, starlette, pydantic, uvicorn) travel in the git-ignored .whl/; the
# peers of the kernel stages (mamba_ssm, vLLM's conv) in .peer/ (docs/kernels.md).
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
W=$(mktemp -d)
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=python3
MS="$PY -m mambaserve.cli"
PRESET=nemotron-nano-9b-v2
# fastapi 0.165 imports opentelemetry-api, which the GPU image lacks: its wheel is in .whl too
if [ -d .whl ] && ! $PY -c "import fastapi, uvicorn, prometheus_client" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if [ -d .whl/plot ] && ! $PY -c "import matplotlib" 2>/dev/null; then  # bench serve's PNG
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site-plot .whl/plot/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site-plot
fi
$PY -c "import fastapi, uvicorn, prometheus_client, httpx, tqdm, matplotlib" 2>&1 | tail -1
if [ -d .whl/xdist ] && ! $PY -c "import xdist" 2>/dev/null; then  # parallel GPU test workers
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site-xdist .whl/xdist/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site-xdist
fi
# pytest workers of the GPU test stages (each compiles its own kernels: the compiles, not the
# GPU, bound those stages): TEST_WORKERS (default 3: 8 ran an H100 out of memory) when
# pytest-xdist imports, else one process
XDIST=""
$PY -c "import xdist" 2>/dev/null && [ "${TEST_WORKERS:-3}" -gt 1 ] && XDIST="-n ${TEST_WORKERS:-3}"

log() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
run() {  # run STAGE_NAME DEFAULT_TIMEOUT CMD...
    local name=$1 limit=$2; shift 2
    local var="STAGE_TIMEOUT_${name//[-.]/_}"
    limit=${!var:-$limit}
    log "$name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    log "$name: exit ${PIPESTATUS[0]}"
}

stage_tests-attention() {  # the attention and graph GPU tests only (after attention changes)
    run tests-attention 200 $PY -m pytest -q -x -p no:cacheprovider tests/ops/test_paged_attention.py \
        tests/ops/test_triton_paged_attention.py tests/engine/test_cuda_graph.py -k "cuda or gpu"
}
stage_tests-quick() {  # the newest kernels' GPU tests and the whole model through graphs vs eager
    run tests-quick 150 $PY -m pytest -q -x -p no:cacheprovider tests/ops/test_triton_activation.py \
        tests/ops/test_paged_attention.py tests/engine/test_cuda_graph.py -k "cuda or gpu or triton"
}
stage_tests-ssd() {  # the SSD scan's GPU tests (9B shapes, bf16, knobs)
    run tests-ssd 150 $PY -m pytest -q -x -p no:cacheprovider tests/ops/test_triton_ssd.py
}
stage_tests() {  # every CUDA-only test: compiled Triton kernels at real shapes, decode graphs,
    # the forward's tail on the logits rows
    run tests 300 $PY -m pytest -q -x -p no:cacheprovider $XDIST tests/ops \
        tests/engine/test_cuda_graph.py tests/models/test_output_rows.py -k "cuda or gpu or triton"
}
stage_check() {  # exactness of the engine on CUDA vs transformers (tiny model), graphs too
    # the GPU image's transformers 5.17 normalizes Bamba / Granite / Mamba2's gated norm over the
    # whole width (benchmarks.md); a newer one travels in .whl/tf when the GPU's is that old
    local tf=""
    if [ -d .whl/tf ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tf \
            .whl/tf/*.whl && tf=/tmp/tf:
    fi
    PYTHONPATH=$tf$PYTHONPATH run check 150 $PY scripts/gpu_check.py --out "$W/gpu_check.json"
}
stage_prefix-attention() {  # the tiled paged attention behind a cached prefix: tiles and key
    # partitions against the launcher's default (kernels.md "Prefill attention behind a cached
    # prefix")
    run prefix-attention 300 $PY scripts/prefix_attention_sweep.py
}
stage_gemv() {  # the few-rows linear vs cuBLAS at the presets' decode shapes (kernels.md)
    run gemv 300 $PY scripts/gemv_sweep.py --out "$W/gemv_sweep.json"
}
stage_gemv-rules() {  # the few-rows linear's one-row rules inside the engine: batch-1 decode of
    # Granite-micro and the 9B profiled per launch grid, the default rules vs FMAs at every shape
    # (PDL off: with it on each kernel's time includes its wait for the one before)
    for p in granite-4.0-h-micro $PRESET; do
        for r in default fma-one-row; do
            MAMBASERVE_PDL=0 run "gemv-rules-$p-$r" 200 $PY scripts/gemv_rules_in_engine.py \
                --preset $p --rules $r \
                --out "$W/gemv_rules_${p}_$r.json"
        done
    done
    # batch 8: the narrow products' (out_proj, down, o_proj) launch variants (run 27)
    for n in "" "block_n=16,split_k=1" "block_n=64,split_k=4"; do
        MAMBASERVE_PDL=0 run "gemv-rules-b8-${n:-default}" 200 $PY scripts/gemv_rules_in_engine.py \
            --preset $PRESET --batch-size 8 --steps 8 ${n:+--narrow $n} \
            --out "$W/gemv_rules_b8_${n:-default}.json"
    done
}
stage_decode-kernels() {  # the small per-layer decode kernels' launch settings (kernels.md)
    run decode-kernels 300 $PY scripts/decode_small_kernels_sweep.py \
        --out "$W/decode_small_kernels.json"
}
stage_audit() {
    run audit 120 $MS audit-syncs --device cuda
}
stage_prefill() {  # prefill-only requests: TTFT, throughput, MFU
    run prefill 240 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1,2,4,8,16,32 --input-len 512,2048 --output-len 1 --out "$W/prefill.json"
}
stage_decode() {  # decode steps through the CUDA graphs
    run decode 240 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1,8,32,64,128,256 --input-len 512 --output-len 48 \
        --engine enforce_eager=false,chunked_prefill_size=16384 --out "$W/decode_graphs.json"
}
stage_decode-eager() {
    run decode-eager 180 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1,8,32,64,128,256 --input-len 512 --output-len 24 \
        --engine enforce_eager=true,chunked_prefill_size=16384 --out "$W/decode_eager.json"
}
stage_hf() {  # transformers on the same shapes (its torch path: no mamba_ssm kernels here)
    run hf-prefill 200 $MS bench one-batch --preset $PRESET --backend hf --device cuda \
        --dtype bfloat16 --batch-size 1,8 --input-len 512,2048 --output-len 1 \
        --out "$W/hf_prefill.json"
    run hf-decode 150 $MS bench one-batch --preset $PRESET --backend hf --device cuda \
        --dtype bfloat16 --batch-size 1,8,32 --input-len 512 --output-len 16 \
        --out "$W/hf_decode.json"
}
stage_ab() {  # graphs vs eager, interleaved rounds with an A-vs-A drift control
    run ab 240 $MS bench ab --preset $PRESET --device cuda --dtype bfloat16 \
        --a enforce_eager=true --b enforce_eager=false --rounds 3 --num-prompts 32 \
        --input-len 256 --output-len 64 --out "$W/ab_graphs.json"
}
stage_serve() {  # the OpenAI server at the 9B preset, then bench serve against it
    local dir=$W/preset
    $PY -c "from mambaserve.bench.presets import preset_config, write_config; \
write_config(preset_config('$PRESET'), '$dir')"
    log "serve: starting the server"
    $MS serve "$dir" --device cuda --dtype bfloat16 --load-format dummy --no-enforce-eager \
        --max-num-seqs 64 --chunked-prefill-size 8192 --max-model-len 4096 --port 8123 \
        --log-level warning >>"$LOG" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do
        $PY -c "import httpx; httpx.get('http://127.0.0.1:8123/health').raise_for_status()" \
            2>/dev/null && break
        sleep 2
    done
    run serve-bench 240 $MS bench serve --base-url http://127.0.0.1:8123 --dataset random \
        --input-len 1024 --output-len 256 --num-prompts 256 --max-concurrency 64 \
        --disable-tqdm --out "$W/serve.json" --plot "$W/serve.png"
    run serve-rate 150 $MS bench serve --base-url http://127.0.0.1:8123 --dataset random \
        --input-len 1024 --output-len 256 --num-prompts 200 --request-rate 8 \
        --disable-tqdm --out "$W/serve_rate8.json" --plot "$W/serve_rate8.png" --seed 1
    $PY -c "import httpx; print(httpx.get('http://127.0.0.1:8123/metrics').text)" \
        >"$W/serve_metrics.txt" 2>&1
    kill -TERM $pid; wait $pid
    log "serve: server exit $?"
}
start_server() {  # start_server DIR PORT EXTRA_FLAGS...: the 9B preset server, waits for /health
    local dir=$1 port=$2; shift 2
    $MS serve "$dir" --device cuda --dtype bfloat16 --load-format dummy --no-enforce-eager \
        --max-num-seqs 64 --chunked-prefill-size 8192 --max-model-len 8192 --port "$port" \
        --log-level warning "$@" >>"$LOG" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 150); do
        $PY -c "import httpx; httpx.get('http://127.0.0.1:$port/health').raise_for_status()" \
            2>/dev/null && return 0
        sleep 2
    done
    log "server on $port did not come up"
}
stop_server() {  # stop_server PORT NAME: save /metrics, stop the server
    $PY -c "import httpx; print(httpx.get('http://127.0.0.1:$1/metrics').text)" \
        >"$W/metrics_$2.txt" 2>&1
    kill -TERM $SERVER_PID; wait $SERVER_PID
    log "server $2: exit $?"
}
stage_load() {  # serving under load: closed loop vs the one-batch ideal, Poisson ITL, multi-turn
    local dir=$W/preset           # prefix cache on vs off, the device's idle share while decoding
    $PY -c "from mambaserve.bench.presets import preset_config, write_config; \
write_config(preset_config('$PRESET'), '$dir')"
    run load-ideal 240 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 8,64 --input-len 1024 --output-len 32 \
        --engine enforce_eager=false,chunked_prefill_size=8192 --out "$W/one_batch_ideal.json"
    start_server "$dir" 8123 ${LOAD_FLAGS:-}
    local mt="--dataset multiturn --shared-prefix-len 2048 --num-turns 4 --input-len 128 \
        --output-len 128 --num-prompts 128 --request-rate 2 --max-concurrency 16 --think-time 1"
    run load-closed 240 $MS bench serve --base-url http://127.0.0.1:8123 --dataset random \
        --input-len 1024 --output-len 256 --num-prompts 256 --max-concurrency 64 \
        --ideal-from "$W/one_batch_ideal.json" --disable-tqdm --out "$W/load_closed.json" \
        --plot "$W/load_closed.png"
    run load-rate8 150 $MS bench serve --base-url http://127.0.0.1:8123 --dataset random \
        --input-len 1024 --output-len 256 --num-prompts 200 --request-rate 8 --seed 1 \
        --disable-tqdm --out "$W/load_rate8.json" --plot "$W/load_rate8.png"
    run load-multiturn-off 200 $MS bench serve --base-url http://127.0.0.1:8123 $mt \
        --disable-tqdm --out "$W/load_multiturn_off.json"
    stop_server 8123 nocache
    start_server "$dir" 8124 --enable-prefix-caching ${LOAD_FLAGS:-}
    run load-multiturn-on 200 $MS bench serve --base-url http://127.0.0.1:8124 $mt \
        --disable-tqdm --out "$W/load_multiturn_on.json"
    stop_server 8124 cache
    stage_load-profile
}
stage_fp8-serve() {  # bench serve at concurrency 64 (1024 in / 256 out) with FP8 weights quantized
    local dir=$W/preset  # at load, against FP8's own one-batch ideal (stage load: bf16's)
    $PY -c "from mambaserve.bench.presets import preset_config, write_config; \
write_config(preset_config('$PRESET'), '$dir')"
    run fp8-serve-ideal 240 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 8,64 --input-len 1024 --output-len 32 \
        --engine enforce_eager=false,chunked_prefill_size=8192,quantization=fp8 \
        --out "$W/one_batch_ideal_fp8.json"
    start_server "$dir" 8125 --quantization fp8
    run fp8-serve-closed 240 $MS bench serve --base-url http://127.0.0.1:8125 --dataset random \
        --input-len 1024 --output-len 256 --num-prompts 256 --max-concurrency 64 \
        --ideal-from "$W/one_batch_ideal_fp8.json" --disable-tqdm --out "$W/fp8_serve_closed.json"
    stop_server 8125 fp8
}
stage_load-profile() {  # the device's idle share in batch-64 decode steps, synchronous vs overlapped
    for a in false true; do
        run "load-profile-async-$a" 180 $MS bench profile --preset $PRESET --device cuda \
            --dtype bfloat16 --batch-size 64 --input-len 1024 --steps 16 \
            --engine enforce_eager=false,async_scheduling=$a --out "$W/profile_decode_async_$a.json"
    done
}
stage_load-sweep() {  # closed loop and Poisson 8 req/s at each prefill cap (LOAD_CAPS), server flags
    # SWEEP_FLAGS, file names tagged SWEEP_TAG
    local dir=$W/preset port=${SWEEP_PORT:-8130}
    $PY -c "from mambaserve.bench.presets import preset_config, write_config; \
write_config(preset_config('$PRESET'), '$dir')"
    [ -f "$W/one_batch_ideal.json" ] || [ -n "${LOAD_NO_IDEAL:-}" ] || run load-ideal 240 $MS bench one-batch --preset $PRESET \
        --device cuda --dtype bfloat16 --batch-size 8,64 --input-len 1024 --output-len 32 \
        --engine enforce_eager=false,chunked_prefill_size=8192 --out "$W/one_batch_ideal.json"
    for cap in ${LOAD_CAPS:-256 1024 2048}; do
        port=$((port + 1))
        start_server "$dir" $port --max-step-prefill-tokens $cap ${SWEEP_FLAGS:-}
        run "sweep-closed-$cap${SWEEP_TAG:-}" 120 $MS bench serve --base-url http://127.0.0.1:$port \
            --dataset random --input-len 1024 --output-len 256 --num-prompts 128 \
            --max-concurrency 64 \
            $( [ -n "${LOAD_NO_IDEAL:-}" ] || echo --ideal-from "$W/one_batch_ideal.json") --disable-tqdm \
            --out "$W/sweep_closed_$cap${SWEEP_TAG:-}.json" --plot "$W/sweep_closed_$cap${SWEEP_TAG:-}.png"
        run "sweep-rate8-$cap${SWEEP_TAG:-}" 90 $MS bench serve --base-url http://127.0.0.1:$port \
            --dataset random --input-len 1024 --output-len 256 --num-prompts 120 --request-rate 8 \
            --seed 1 --disable-tqdm --out "$W/sweep_rate8_$cap${SWEEP_TAG:-}.json" --plot "$W/sweep_rate8_$cap${SWEEP_TAG:-}.png"
        stop_server $port "cap$cap${SWEEP_TAG:-}"
    done
}
stage_trace() {  # every Triton compile / autotune of a one-batch sweep, and the run it fell in
    run trace 300 $PY scripts/trace_compiles.py bench one-batch --preset ${TRACE_PRESET:-granite-4.0-h-micro} \
        --device cuda --dtype bfloat16 --batch-size 1,8,64 --input-len 2048 --output-len 8 \
        --engine enforce_eager=false --out "$W/trace_one_batch.json"
}
stage_profile-mixed() {  # a decode batch of 64, then one 1024-token prompt prefilled beside it
    run profile-mixed 240 $MS bench profile --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 64 --input-len 1024 --steps 8 --mixed-len 1024 \
        --engine enforce_eager=false${PROFILE_ENGINE:+,$PROFILE_ENGINE} --out "$W/profile_mixed.json"
}
stage_profile() {  # where the device time of a prefill step and a decode step goes
    run profile-8x2048 240 $MS bench profile --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 8 --input-len 2048 --steps 4 --engine enforce_eager=false \
        --out "$W/profile_8x2048.json"
    run profile-1x2048 180 $MS bench profile --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1 --input-len 2048 --steps 16 --engine enforce_eager=false \
        --out "$W/profile_1x2048.json"
}
stage_attention() {  # prefill attention: per-token vs tiled kernel vs torch SDPA
    run attention 180 $MS bench kernels --only attention --sweep --out "$W/attention.json"
}
stage_ncu() {  # hardware counters of the SSD scan's launches, ours and mamba_ssm's (1x8192)
    PYTHONPATH=$PYTHONPATH:.peer/mamba_ssm-2.3.2.post1 run ncu 240 ncu --clock-control none \
        --profile-from-start off --kernel-name regex:'_chunk_scan|_chunk_state|_state_passing' \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis $PY scripts/ssd_once.py 1x8192
}
stage_kernels() {  # every kernel against its reference and the peers (KERNELS_ARGS=--sweep)
    PYTHONPATH=$PYTHONPATH:.peer/mamba_ssm-2.3.2.post1 run kernels 300 $MS bench kernels \
        ${KERNELS_ARGS:-} --out "$W/kernels.json"
}
stage_overlap() {  # overlap scheduling on the GPU: its tests, the sync audit, on vs off A/B
    run overlap-tests 240 $PY -m pytest -q -x -p no:cacheprovider tests/engine/test_cuda_graph.py \
        tests/models/test_sparse_moe.py tests/engine/test_overlap.py tests/engine/test_logits_processing.py
    run overlap-audit 90 $MS audit-syncs --device cuda
    run overlap-ab 240 $MS bench ab --preset $PRESET --device cuda --dtype bfloat16 \
        --a async_scheduling=false --b async_scheduling=true --rounds 2 --num-prompts 32 \
        --input-len 256 --output-len 64 --out "$W/ab_overlap.json"
}
stage_moe() {  # the sparse experts and the routing: GPU tests, kernel timings, the sync audit of
    # an MoE model
    run moe-tests 240 $PY -m pytest -q -x -p no:cacheprovider tests/ops/test_triton_moe_experts.py \
        tests/ops/test_moe_experts.py tests/layers/test_moe.py tests/ops/test_triton_moe_routing.py \
        tests/ops/test_triton_moe_align.py
    run moe-kernels 240 $MS bench kernels --only moe --out "$W/kernels_moe.json"
    local dir=$W/moe_small
    $PY -c "from mambaserve.bench.presets import preset_config, write_config; \
c = preset_config('nemotron-3-nano-30b-a3b'); \
c.update(num_hidden_layers=4, hybrid_override_pattern='ME*E', vocab_size=1024); \
write_config(c, '$dir')"
    run moe-audit 120 $MS audit-syncs --model "$dir" --device cuda --load-format dummy
}
stage_moe-presets() {  # one batch at the MoE presets (FLOPs and bytes on active parameters),
    # overlap on; then transformers' GraniteMoeHybrid on granite-4.0-h-small's shapes (HF peer)
    for p in nemotron-3-nano-30b-a3b granite-4.0-h-small; do
        run "one-batch-$p" 280 $MS bench one-batch --preset $p --device cuda --dtype bfloat16 \
            --batch-size 1,8,64 --input-len 2048 --output-len 24 \
            --engine enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true \
            --out "$W/one_batch_$p.json"
    done
    run hf-granite-4.0-h-small 280 $MS bench one-batch --preset granite-4.0-h-small --backend hf \
        --device cuda --dtype bfloat16 --batch-size 1 --input-len 512,2048 --output-len 8 \
        --out "$W/hf_granite-4.0-h-small.json"
}
stage_prefill-graphs() {  # small prefill / mixed steps through CUDA graphs: GPU tests, batch-1 TTFT on vs off
    run prefill-graph-tests 200 $PY -m pytest -q -x -p no:cacheprovider tests/engine/test_prefill_graph.py \
        tests/engine/test_cuda_graph.py -k "cuda or gpu"
    for g in ${PG_LIST:-256 0}; do
        run "ttft-graphs-$g" 200 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
            --batch-size 1 --input-len 32,128,512,2048 --output-len 8 \
            --engine enforce_eager=false,cuda_graph_max_prefill_tokens=$g --out "$W/ttft_graphs_$g.json"
    done
}
stage_suffix() {  # single-request latency with the prefix cache on, overlap on (a stream's view):
    # a follow-up turn's uncached suffix after a cached 2048-token history, fresh prompts and
    # batch-1 decode with caching on and off, then where the follow-up turn's step goes and where
    # a fresh 2048-token prompt's goes with caching on and off
    local eng="enforce_eager=false,async_scheduling=true"
    run suffix-ttft 200 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1 --input-len 32,128,512 --output-len 16 --cached-prefix-len 2048 --repeats 3 \
        --engine "$eng,enable_prefix_caching=true" --out "$W/suffix_ttft.json"
    for pc in true false; do
        run "suffix-cache-$pc" 200 $MS bench one-batch --preset $PRESET --device cuda \
            --dtype bfloat16 --batch-size 1 --input-len 32,512,2048 --output-len 24 \
            --engine "$eng,enable_prefix_caching=$pc" --out "$W/suffix_cache_$pc.json"
    done
    run suffix-profile 150 $MS bench profile --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1 --input-len 32 --cached-prefix-len 2048 --steps 2 \
        --engine "$eng,enable_prefix_caching=true" --out "$W/profile_suffix.json"
    for pc in true false; do
        run "suffix-profile-2048-$pc" 150 $MS bench profile --preset $PRESET --device cuda \
            --dtype bfloat16 --batch-size 1 --input-len 2048 --steps 2 \
            --engine "$eng,enable_prefix_caching=$pc" --out "$W/profile_2048_cache_$pc.json"
    done
}
FAMILIES=${FAMILIES:-falcon-h1-7b granite-4.0-h-micro mamba-codestral-7b}
stage_families() {  # the other families' presets: one batch, then where a prefill / decode step goes
    for p in $FAMILIES; do
        run "one-batch-$p" 200 $MS bench one-batch --preset $p --device cuda --dtype bfloat16 \
            --batch-size 1,8 --input-len 2048 --output-len 24 \
            --engine enforce_eager=false,chunked_prefill_size=16384 --out "$W/one_batch_$p.json"
        run "profile-decode-$p" 150 $MS bench profile --preset $p --device cuda --dtype bfloat16 \
            --batch-size 1 --input-len 2048 --steps 16 --engine enforce_eager=false \
            --out "$W/profile_1x2048_$p.json"
        [ -n "${FAMILIES_NO_PREFILL_PROFILE:-}" ] || run "profile-prefill-$p" 150 $MS bench profile \
            --preset $p --device cuda --dtype bfloat16 --batch-size 8 --input-len 2048 --steps 2 \
            --engine enforce_eager=false,chunked_prefill_size=16384 --out "$W/profile_8x2048_$p.json"
    done
}
stage_families-hf() {  # transformers' class of each family on the same shapes (its torch path)
    for p in $FAMILIES; do
        run "hf-$p" 200 $MS bench one-batch --preset $p --backend hf --device cuda \
            --dtype bfloat16 --batch-size 1 --input-len 512,2048 --output-len 8 \
            --out "$W/hf_$p.json"
    done
}
stage_latency() {  # batch-1 TTFT and decode with overlap scheduling on (a stream's view), twice
    # for the 9B preset (run-to-run spread; each TTFT the median of 5 fresh prompts), its
    # batch-8 decode, once per family (b 1 and 8)
    for i in 1 2; do
        run "latency-9b-$i" 200 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
            --batch-size 1 --input-len 32,128,512,1024,2048 --output-len 24 --repeats 5 \
            --engine enforce_eager=false,async_scheduling=true --out "$W/latency_9b_$i.json"
    done
    run latency-9b-b8 200 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 8 --input-len 2048 --output-len 24 \
        --engine enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true \
        --out "$W/latency_9b_b8.json"
    for p in $FAMILIES; do
        run "latency-$p" 200 $MS bench one-batch --preset $p --device cuda --dtype bfloat16 \
            --batch-size 1,8 --input-len 2048 --output-len 24 \
            --engine enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true \
            --out "$W/latency_$p.json"
    done
}
stage_targets() {  # the single-request latency targets in one pass (overlap on, the 9B preset):
    # batch-1 TTFT and decode at 32-2,048 tokens (medians of 5 fresh prompts), batch-8 decode at
    # ~2k context, the follow-up turn (32 / 128 new tokens after 2,048 cached), and 512 / 2,048
    # fresh tokens with prefix caching on (docs/benchmarks.md "Targets")
    local eng="enforce_eager=false,async_scheduling=true"
    run targets-b1 200 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1 --input-len 32,128,512,1024,2048 --output-len 24 --repeats 5 \
        --engine "$eng" --out "$W/targets_b1.json"
    run targets-b8 150 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 8 --input-len 2048 --output-len 24 \
        --engine "$eng,chunked_prefill_size=16384" --out "$W/targets_b8.json"
    run targets-follow-up 150 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1 --input-len 32,128 --output-len 16 --cached-prefix-len 2048 --repeats 5 \
        --engine "$eng,enable_prefix_caching=true" --out "$W/targets_follow_up.json"
    run targets-cache-on 150 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1 --input-len 512,2048 --output-len 24 --repeats 5 \
        --engine "$eng,enable_prefix_caching=true" --out "$W/targets_cache_on.json"
}
stage_head-start() {  # the prefill graphs' head start on and off in one engine, interleaved:
    # TTFT of fresh 32-2,048-token prompts and of 32 / 128-token follow-up suffixes
    run head-start 400 $PY scripts/head_start_ab.py --preset $PRESET --fresh 32,128,512,2048 \
        --follow-up 32,128 --cached-prefix-len 2048 --rounds 12 --out "$W/head_start.json"
}
stage_host() {  # the host's time per step before its forward starts (bench host), at the 9B
    # preset: lone prompts (TTFT's host part) and steady decode batches, graphs on
    run host-9b 300 $MS bench host --preset $PRESET --device cuda --dtype bfloat16 \
        --input-len 32,128,512,2048 --decode-batch 1,8,64 --repeats 30 \
        --engine enforce_eager=false --out "$W/host_9b.json"
    # the same lone prompts at lengths no template holds (a server's prompts of varied lengths)
    run host-9b-new-lengths 300 $MS bench host --preset $PRESET --device cuda --dtype bfloat16 \
        --input-len 32,128,512,2048 --decode-batch 1 --repeats 20 --new-lengths \
        --engine enforce_eager=false --out "$W/host_9b_new_lengths.json"
    # what one launch of each kind costs the host (an eager step is ~1,000 of them)
    run host-launch-cost 60 $PY scripts/host_launch_cost.py --out "$W/host_launch_cost.json"
}
stage_pdl() {  # programmatic dependent launch (MAMBASERVE_PDL, on by default): its GPU test,
    # then batch-1 / 8 latency and the families' decode with it off (0) and on (1), interleaved
    # (kernels.md)
    run pdl-tests 120 $PY -m pytest -q -p no:cacheprovider tests/ops/test_triton_pdl.py
    for i in 1 2; do
        for on in 0 1; do
            MAMBASERVE_PDL=$on run "pdl-$on-9b-$i" 200 $MS bench one-batch --preset $PRESET \
                --device cuda --dtype bfloat16 --batch-size 1,8 --input-len 32,2048 \
                --output-len 24 --engine enforce_eager=false,async_scheduling=true \
                --out "$W/pdl_${on}_9b_$i.json"
        done
    done
    for p in $FAMILIES; do
        for on in 0 1; do
            MAMBASERVE_PDL=$on run "pdl-$on-$p" 200 $MS bench one-batch --preset $p --device cuda \
                --dtype bfloat16 --batch-size 1,8 --input-len 2048 --output-len 24 \
                --engine enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true \
                --out "$W/pdl_${on}_$p.json"
        done
    done
}
stage_prefetch() {  # the FP8 few-rows linear's weight prefetch before its PDL wait (tuning knob
    # prefetch_bytes, kernels.md): its GPU tests, then FP8 decode batch 1 / 8 at context 2048
    # with it off (0) and at its default (2048), interleaved, through MAMBASERVE_TUNING
    run prefetch-tests 200 $PY -m pytest -q -p no:cacheprovider $XDIST \
        tests/ops/test_triton_fp8_gemv.py tests/ops/test_triton_pdl.py
    for i in 1 2; do
        for pf in 0 2048; do
            MAMBASERVE_TUNING=fp8_gemv.prefetch_bytes=$pf run "prefetch-$pf-$i" 200 $MS bench \
                one-batch --preset $PRESET --device cuda --dtype bfloat16 --batch-size 1,8 \
                --input-len 2048 --output-len 48 --engine \
                enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true,quantization=fp8 \
                --out "$W/prefetch_${pf}_$i.json"
        done
    done
}
stage_sampler() {  # the sampler's one-op path (ops/sample_rows.py): its GPU tests, then decode
    # greedy, at temperature 1 and with top_p 0.9 (Granite-micro batch 1 / 8, the 9B batch 1 / 64)
    run sampler-tests 200 $PY -m pytest -q -p no:cacheprovider tests/ops/test_triton_sample_rows.py \
        tests/layers/test_sampler.py tests/layers/test_logits_processors.py \
        tests/engine/test_logits_processing.py
    local setting
    for setting in "0 1.0" "1 1.0" "1 0.9"; do
        set -- $setting
        run "sampler-granite-t$1-p$2" 200 $MS bench one-batch --preset granite-4.0-h-micro \
            --device cuda --dtype bfloat16 --batch-size 1,8 --input-len 2048 --output-len 24 \
            --temperature $1 --top-p $2 \
            --engine enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true \
            --out "$W/sampler_granite_t$1_p$2.json"
        run "sampler-9b-t$1-p$2" 200 $MS bench one-batch --preset $PRESET --device cuda \
            --dtype bfloat16 --batch-size 1,64 --input-len 512 --output-len 24 \
            --temperature $1 --top-p $2 \
            --engine enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true \
            --out "$W/sampler_9b_t$1_p$2.json"
    done
}
stage_dense-attn() {  # fresh prefill rows through SDPA (MAMBASERVE_DENSE_PREFILL) off and on,
    # interleaved: its GPU tests, the 9B's batch-1 TTFTs and 8x2048, the families' 1 / 8 x 2048
    run dense-attn-tests 200 $PY -m pytest -q -p no:cacheprovider \
        tests/ops/test_triton_paged_attention.py -k dense
    for i in 1 2; do
        for on in 0 1; do
            MAMBASERVE_DENSE_PREFILL=$on run "dense-$on-9b-$i" 200 $MS bench one-batch \
                --preset $PRESET --device cuda --dtype bfloat16 --batch-size 1,8 \
                --input-len 512,2048 --output-len 4 \
                --engine enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true \
                --out "$W/dense_${on}_9b_$i.json"
        done
    done
    for p in falcon-h1-7b granite-4.0-h-micro; do  # the families with attention
        for on in 0 1; do
            MAMBASERVE_DENSE_PREFILL=$on run "dense-$on-$p" 200 $MS bench one-batch --preset $p \
                --device cuda --dtype bfloat16 --batch-size 1,8 --input-len 2048 --output-len 4 \
                --engine enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true \
                --out "$W/dense_${on}_$p.json"
        done
    done
}
stage_fp8-sweep() {  # the FP8 few-rows linear's launch settings and the quantization passes that
    # feed it (norms writing FP8 rows, the activation in the quantization launch; kernels.md)
    run fp8-sweep 540 $PY scripts/fp8_gemv_sweep.py --m 1,8,64 --out "$W/fp8_gemv_sweep.json"
}
stage_fp8-rows() {  # FP8 decode batches of 4-32 rows: the tensor-core launch rules against the
    # former ones, _scaled_mm and the bf16 product per projection, then one batch at batch 1 / 8 /
    # 16 / 32 (kernels.md)
    run fp8-rows-sweep 200 $PY scripts/fp8_gemv_sweep.py --only gemv --m 4,8,16,32 \
        --candidates rules --out "$W/fp8_rows_rules.json"
    run fp8-rows-batch 240 $MS bench one-batch --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1,8,16,32 --input-len 2048 --output-len 24 \
        --engine enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true,quantization=fp8 \
        --out "$W/fp8_rows_batch.json"
}
stage_fp8-state() {  # batch-64 decode, bf16 and FP8 weights, with float32 and bfloat16 SSM state
    # (the bytes per step that bound FP8's gain there; benchmarks.md, FP8)
    for st in float32 bfloat16; do
        for q in "" ",quantization=fp8"; do
            run "fp8-state-$st${q:+-fp8}" 240 $MS bench one-batch --preset $PRESET --device cuda \
                --dtype bfloat16 --batch-size 64 --input-len 1024 --output-len 24 \
                --engine "enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true,mamba_ssm_dtype=$st$q" \
                --out "$W/fp8_state_$st${q:+_fp8}.json"
        done
    done
}
stage_latency-profile() {  # where a 512-token prompt's prefill step goes, twice (its TTFT has
    # two modes, 22-25 and 43-44 ms), and every Triton compile of the latency sweep
    for i in 1 2; do
        run "profile-1x512-$i" 150 $MS bench profile --preset $PRESET --device cuda \
            --dtype bfloat16 --batch-size 1 --input-len 512 --steps 4 \
            --engine enforce_eager=false,async_scheduling=true --out "$W/profile_1x512_$i.json"
    done
    run trace-latency 200 $PY scripts/trace_compiles.py bench one-batch --preset $PRESET \
        --device cuda --dtype bfloat16 --batch-size 1 --input-len 32,128,512,2048 \
        --output-len 24 --engine enforce_eager=false,async_scheduling=true \
        --out "$W/trace_latency.json"
}
stage_attention-decode() {  # the per-token paged attention's tuning at the presets' shapes
    run attention-decode 200 $PY scripts/decode_attention_sweep.py --out "$W/decode_attention.json"
}
stage_tp() {  # tensor parallelism on TP_SIZE GPUs (default 2): exactness vs one rank, one batch
    # TP=1 vs TP=N, where the step goes (the all-reduces: group "communication"), serving, 47B
    local n=${TP_SIZE:-2} eng="enforce_eager=false,chunked_prefill_size=16384,async_scheduling=true"
    run tp-check 500 $PY scripts/tp_check.py --preset $PRESET --layers ${TP_LAYERS:-8} --tp $n \
        --device cuda --out "$W/tp_check.json"
    for t in 1 $n; do
        run "tp-one-batch-$t" 300 $MS bench one-batch --preset $PRESET --device cuda \
            --dtype bfloat16 --batch-size 1,8,64 --input-len 2048 --output-len 24 \
            --engine "$eng,tensor_parallel_size=$t" --out "$W/tp_one_batch_$t.json"
    done
    run tp-profile-decode 200 $MS bench profile --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 1 --input-len 2048 --steps 16 \
        --engine enforce_eager=false,tensor_parallel_size=$n --out "$W/tp_profile_1x2048.json"
    run tp-profile-prefill 200 $MS bench profile --preset $PRESET --device cuda --dtype bfloat16 \
        --batch-size 8 --input-len 2048 --steps 2 \
        --engine enforce_eager=false,chunked_prefill_size=16384,tensor_parallel_size=$n \
        --out "$W/tp_profile_8x2048.json"
    local dir=$W/preset
    $PY -c "from mambaserve.bench.presets import preset_config, write_config; \
write_config(preset_config('$PRESET'), '$dir')"
    start_server "$dir" 8160 --tensor-parallel-size $n
    run tp-serve-closed 200 $MS bench serve --base-url http://127.0.0.1:8160 --dataset random \
        --input-len 1024 --output-len 256 --num-prompts 128 --max-concurrency 64 --disable-tqdm \
        --out "$W/tp_serve_closed.json" --plot "$W/tp_serve_closed.png"
    stop_server 8160 "tp$n"
    for t in 1 $n; do  # the larger preset: 94 GB of bf16 weights
        run "tp-47b-$t" 400 $MS bench one-batch --preset nemotron-h-47b --device cuda \
            --dtype bfloat16 --batch-size 1,8 --input-len 2048 --output-len 16 \
            --engine "$eng,tensor_parallel_size=$t" --out "$W/tp_47b_$t.json"
    done
}
stage_fp8() {  # FP8 weights (docs/quantization.md): GPU tests, GEMMs, one batch FP8 vs bf16, drift
    run fp8-tests 300 $PY -m pytest -q -x -p no:cacheprovider tests/ops/test_fp8_matmul.py \
        tests/layers/test_fp8_linear.py
    # the few-rows kernel (ops/triton/fp8_gemv.py), the decode default: its GPU tests
    run fp8-gemv-tests 300 $PY -m pytest -q -p no:cacheprovider tests/ops/test_triton_fp8_gemv.py \
        tests/ops/test_triton_fp8_quant.py
    # the FP8 checkpoints written by the tests, through the engine on the GPU (their calibration
    # runs transformers: the newer one of .whl/tf when it travels, as stage check does)
    local tf=""
    if [ -d .whl/tf ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tf \
            .whl/tf/*.whl && tf=/tmp/tf:
    fi
    PYTHONPATH=$tf$PYTHONPATH run fp8-checkpoint-tests 300 $PY -m pytest -q -p no:cacheprovider \
        $XDIST tests/models/test_fp8_checkpoint.py
    [ -n "${FP8_QUICK:-}" ] || run fp8-audit 120 $MS audit-syncs --device cuda --dtype bfloat16 --quantization fp8
    [ -n "${FP8_QUICK:-}" ] || MAMBASERVE_FP8_GEMV=0 run fp8-scaled-mm-audit 120 $MS audit-syncs \
        --device cuda --dtype bfloat16 --quantization fp8
    [ -n "${FP8_QUICK:-}" ] || run fp8-gemm 200 $PY scripts/fp8_gemm_bench.py --out "$W/fp8_gemm.json"
    for q in bf16 fp8; do
        local eng="enforce_eager=false,chunked_prefill_size=16384"
        [ $q = fp8 ] && eng="$eng,quantization=fp8"
        run "one-batch-$q" 300 $MS bench one-batch --preset $PRESET --device cuda \
            --dtype bfloat16 --batch-size 1,8,64 --input-len 2048 --output-len 24 \
            --engine "$eng" --out "$W/one_batch_$q.json"
    done
    # FP8 with the few-rows kernel switched off (MAMBASERVE_FP8_GEMV=0: every batch _scaled_mm)
    MAMBASERVE_FP8_GEMV=0 run one-batch-fp8-scaled-mm 300 $MS bench one-batch --preset $PRESET \
        --device cuda --dtype bfloat16 --batch-size 1,8,64 --input-len 2048 --output-len 24 \
        --engine enforce_eager=false,chunked_prefill_size=16384,quantization=fp8 \
        --out "$W/one_batch_fp8_scaled_mm.json"
    run fp8-drift-9b 300 $PY scripts/fp8_drift.py --preset $PRESET --device cuda \
        --dtype bfloat16 --tokens 2048 --out "$W/fp8_drift_9b.json"
    [ -n "${FP8_QUICK:-}" ] || run fp8-drift-demo 120 $PY scripts/fp8_drift.py --model mambaserve/assets/demo_model \
        --device cuda --dtype bfloat16 --tokens 2048 --out "$W/fp8_drift_demo.json"
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee -a "$LOG"
$PY -c "import torch, triton, transformers, sys; print(sys.version.split()[0], torch.__version__, \
triton.__version__, transformers.__version__)" | tee -a "$LOG"
git rev-parse --short HEAD 2>/dev/null | tee -a "$LOG"
for s in "$@"; do "stage_$s"; done
tar czf "$OUT/results.tgz" -C "$W" . && log "results packed: $(tar tzf "$OUT/results.tgz" | tr '\n' ' ')"
