#!/bin/bash
# One call on the lent H200 (device tool): carried wheels, GPU tests, serve cold start, decode benchmark.
# PARTS picks among tests,ptests,restart,early,attention,hybrid,moeprefill,moedecode,upload,bench,serve,load,gemv,host,promptstep; BENCH_ARGS go to benchmarks/gpu_decode.py. Logs land in $OUT.
# HELIOS_* execution switches (helios/switches.py) set here reach gpu_decode.py's runners: it reads them once at start.
# .whl/ holds what the device lacks, for cp312 manylinux (pip download --no-deps --only-binary=:all:
# --python-version 3.12 ...): msgspec granian llguidance gguf tomli_w zstandard brotli prometheus-client fla-core
# einops typer rich, and typer 0.29's pydantic pydantic_core annotated-types typing-inspection annotated-doc shellingham
# typing_extensions (llguidance needs --platform manylinux_2_31_x86_64; without pydantic the CLI, hence export, fails).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
# .whl_tf/, when carried: transformers 5.25 with what it needs (huggingface_hub 2.4, httpx2, tokenizers 0.23, ...),
# for the families the device image's transformers lacks (gemma4, mimo_v2_flash, minimax_m3, muse_spark, ...). Fill it
# here with `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
# --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl_tf transformers==5.25.0
# huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 regex httpx2==2.16.2 httpcore2 h11 anyio truststore
# hf-xet==1.8.0 kernels==0.19.1 tomlkit click` (the venv's versions; ~26 MB).
if [ -d .whl_tf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl \
    || exit 1
fi
export PYTHONUNBUFFERED=1 FLARE_RUN_CUDA_TESTS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
PARTS=${PARTS:-tests,bench,serve}
if [[ ,$PARTS, == *,tests,* ]]; then
  timeout ${TESTS_S:-170} python3 -m pytest -q -rfE -p no:cacheprovider -o faulthandler_timeout=${TEST_HANG_S:-150} \
    ${TEST_ARGS:-} ${TEST_PATHS:-tests/gpu tests/runner/test_cuda_graphs.py tests/ignition/test_aot.py} > "$OUT/tests.log" 2>&1
  echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -${TESTS_TAIL:-15}
fi
if [[ $PARTS == *ptests* ]]; then  # correctness only: a pytest process per group, side by side on the one GPU
  IFS=';' read -ra groups <<< "${PTEST_GROUPS:-tests/gpu}"
  i=0
  for g in "${groups[@]}"; do
    i=$((i + 1))
    timeout ${PTESTS_S:-400} python3 -m pytest -v --tb=short -rfE --durations=8 -p no:cacheprovider \
      -o faulthandler_timeout=${TEST_HANG_S:-300} $g > "$OUT/ptests$i.log" 2>&1 &
  done
  wait
  echo "== ptests"; grep -E "^(FAILED|ERROR)|passed|failed|no tests ran" "$OUT"/ptests*.log
  # one archive: a call brings back at most eight files (session 17 lost two groups' logs)
  (cd "$OUT" && tar czf ptests.tgz ptests*.log && rm -f ptests*.log)
fi
if [[ $PARTS == *serve* ]]; then
  timeout ${SERVE_S:-230} python3 benchmarks/gpu_serve_start.py --work /tmp/serve --out "$OUT" ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1
  echo "== serve rc $?"; tail -45 "$OUT/serve.log"
fi
if [[ ,$PARTS, == *,load,* ]]; then  # reuses the 8B core gpu_serve_start.py exported (serve part), else exports one
  core_arg=(); [ -d /tmp/serve/core-8b ] && core_arg=(--core /tmp/serve/core-8b)
  timeout ${LOAD_S:-330} python3 benchmarks/gpu_serve_load.py --device cuda "${core_arg[@]}" ${LOAD_ARGS:-} \
    > "$OUT/load.log" 2>&1
  echo "== load rc $?"; grep -v "^W1\|Warning" "$OUT/load.log" | tail -25
fi
if [[ ,$PARTS, == *,early,* ]]; then  # the weights' upload beside torch's import (HELIOS_EARLY_UPLOAD) against off
  timeout ${EARLY_S:-200} python3 benchmarks/gpu_early_upload.py --core /tmp/serve/core-8b --repeat 1 \
    > "$OUT/early.log" 2>&1
  echo "== early upload rc $?"; tail -12 "$OUT/early.log"
  for eu in ${EARLY_MODES:-pinned off pinned off pinned off}; do  # alternating: the host's import time drifts
    HELIOS_EARLY_UPLOAD=$eu timeout 60 python3 benchmarks/gpu_serve_start.py --core /tmp/serve/core-8b --repeat 1 \
      --out "$OUT/early_$eu" > "$OUT/early_$eu.log" 2>&1
    echo "-- restart early_upload=$eu rc $?"
    grep -o '"torch imports": [0-9.]*, "load": [0-9.]*\|"ready": [0-9.]*\|"load_weights": [0-9.]*' "$OUT/early_$eu.log" \
      | paste -sd' '
  done
fi
if [[ ,$PARTS, == *,attention,* ]]; then  # decode_qkv's tiles alone at the 8B shape (ATTENTION_ARGS: its options)
  timeout ${ATTENTION_S:-200} python3 benchmarks/gpu_decode_attention.py ${ATTENTION_ARGS:-} > "$OUT/attention.log" 2>&1
  echo "== attention rc $?"; grep -v "^W1" "$OUT/attention.log" | grep -E "^(batch|best|NVIDIA|H)"
fi
if [[ ,$PARTS, == *,restart,* ]]; then  # restarts of the serve part's 8B core: the pinned upload off, then on
  for pinned in ${RESTART_PINNED:-0 1}; do
    HELIOS_PINNED_UPLOAD=$pinned timeout ${RESTART_S:-120} python3 benchmarks/gpu_serve_start.py --core /tmp/serve/core-8b \
      --repeat ${RESTART_REPEAT:-2} --out "$OUT/restart$pinned" > "$OUT/restart$pinned.log" 2>&1
    echo "== restart pinned_upload=$pinned rc $?"; tail -${RESTART_TAIL:-14} "$OUT/restart$pinned.log"
  done
  (cd "$OUT" && tar czf restart.tgz restart* && rm -rf restart0 restart1 restart0.log restart1.log)
fi
if [[ $PARTS == *hybrid* ]]; then  # issue 20's hybrid bars (a dense and a MoE gated-delta hybrid, HF beside)
  timeout ${HYBRID_S:-240} python3 benchmarks/gpu_hybrid.py ${HYBRID_ARGS:-} > "$OUT/hybrid.log" 2>&1
  echo "== hybrid rc $?"; grep -v "Warn\|warn" "$OUT/hybrid.log" | tail -30
fi
if [[ $PARTS == *moeprefill* ]]; then  # the MoE prefill tile sweep (helios.kernels.fused_moe.gemm_config's prefill row)
  timeout ${MOEPREFILL_S:-200} python3 benchmarks/gpu_moe_prefill.py --out "$OUT/moe_prefill.log" ${MOEPREFILL_ARGS:-} \
    > "$OUT/moe_prefill.stdout" 2>&1
  echo "== moeprefill rc $?"; grep -v "Warn\|warn" "$OUT/moe_prefill.stdout" | tail -30
fi
if [[ $PARTS == *moedecode* ]]; then  # one token's expert GEMMs: the dot path against the GEMV variants
  timeout ${MOEDECODE_S:-200} python3 benchmarks/gpu_moe_decode.py --out "$OUT/moe_decode.log" ${MOEDECODE_ARGS:-} \
    > "$OUT/moe_decode.stdout" 2>&1
  echo "== moedecode rc $?"; grep -v "Warn\|warn" "$OUT/moe_decode.stdout" | tail -${MOEDECODE_TAIL:-60}
fi
if [[ ,$PARTS, == *,upload,* ]]; then  # the weights' upload: driver-staged copies against the pinned ring
  timeout ${UPLOAD_S:-120} python3 benchmarks/gpu_upload.py ${UPLOAD_ARGS:-} > "$OUT/upload.log" 2>&1
  echo "== upload rc $?"; grep -v "Warn\|warn" "$OUT/upload.log" | tail -40
fi
if [[ $PARTS == *bench* ]]; then
  timeout ${BENCH_S:-260} python3 benchmarks/gpu_decode.py ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "== bench rc $?"; grep -v "^W1\|^  warnings\|Warning" "$OUT/bench.log" | tail -60
fi
if [[ $PARTS == *gemv* ]]; then
  timeout ${GEMV_S:-240} python3 benchmarks/gpu_gemv.py ${GEMV_ARGS:-} > "$OUT/gemv.log" 2>&1
  echo "== gemv rc $?"; grep -v "^W1\|Warning" "$OUT/gemv.log" | tail -70
fi
if [[ $PARTS == *promptstep* ]]; then  # where a prompt step's fixed cost goes (issue 22's served load)
  timeout ${PROMPTSTEP_S:-200} python3 benchmarks/gpu_prompt_step.py ${PROMPTSTEP_ARGS:-} > "$OUT/prompt_step.log" 2>&1
  echo "== promptstep rc $?"; grep -v "^W1\|Warning" "$OUT/prompt_step.log" | head -${PROMPTSTEP_HEAD:-90}
fi
if [[ $PARTS == *host* ]]; then
  timeout ${HOST_S:-120} python3 benchmarks/gpu_decode.py --host-profile > "$OUT/host.log" 2>&1
  echo "== host rc $?"; grep -v "^W1\|Warning" "$OUT/host.log" | head -45
fi
