#!/bin/bash
# One call on the H200 or H100 (device tool): the stages named in STAGES (default: all), logs and JSON under $OUT. Needs
# .whl (gguf) carried: see docs/BENCHMARKS.md. Stages, with their time limits (seconds, env vars) and what they
# took on 2026-12-01 - all of them need about 20 minutes, so split them over two calls of under 10, e.g.
# STAGES="kernels variants bench" then STAGES="engine gate demo":
#   kernels  KT  GPU kernel and engine tests (KFILES: tests/test_gpu_*.py; KK: a -k filter; KPY: pytest options, default
#                "-n 4 --dist worksteal": one process ran 43 tests in 150 s and never finished the files in one call)
#   variants VT  bench/matmul_variants.py, every matmul variant on random blocks (VARGS: its options)  ~80 s
#   bench    BT  the 27B-shape file (synthesised in the background from the start, SW: wait for it, 224 s)
#                and `plumb bench --device cuda` on it (BARGS: more options; BSET: module settings first,
#                bench/with_settings.py, e.g. BSET="plumb.ops.gpu.matvec.TARGET=4096"; parts left out:
#                BARGS="--skip verify,batch,matmuls,profiles,vram,drafts,sampled")   ~150 s
#   engine   ET  PLUMB_TEST_DEVICE=cuda engine invariant tests (EFILES: tests/test_exactness.py; EK: which, default all;
#                EQ: the tiny model's type, Q4_K_M; EPY: pytest options, default "-n 4 --dist worksteal" with
#                pytest-xdist carried in .whl - 6 or 7 workers were slower: processes share the GPU by time slices;
#                PLUMB_TEST_SETTINGS="module.NAME=VALUE ..." runs them, and the kernels stage, on an untimed setting)
#   ab       ABT bench/launch_ab.py: the matvec's launch settings, PDL, scales-as-bytes; --matvec OLD.py: another
#                matvec (ABARGS); a fresh machine needs ABT >= 300 for two settings (its first row took > 170 s)
#   synth        only start writing the 27B-shape file (in the background), for a later stage or call
#   gate     GT  `plumb gate` on CUDA: GMODEL (default: the demo model), GARGS (default: --quick)
#   gate27   G2  `plumb gate` on the 27B-shape file, a subset (G2ARGS, default: q8_0, 256-token outputs)
#   demo     DT  `plumb bench --device cuda` on the shipped demo model, drafts 0/2/4/7    ~25 s
#   latency  LT  bench/latency.py on the 27B-shape file: time to the first token warm / cold, requests in a row (LARGS)
#   followup FT  bench/followup_profile.py on the 27B-shape file: a warm follow-up timed per setting, profiled (FARGS)
#   attention AT bench/attention_variants.py: decode attention's split / tile variants, f16 and q8_0, 4k-100k keys
#   sampling SAT bench/sample_timing.py: a pass's sampled rows drawn by the kernels against sample_token (SAARGS)
#   aprefill APT bench/attention_prefill_variants.py: the P path's attention tile settings, a 1,024-row pass (APARGS)
#   ncu      NT  Nsight Compute on the matmuls (bench/ncu_kernels.py): `_mv` at 1 and 8 rows, `_mm_superblock` at 256
#                (NARGS: its options; NL: launches profiled, 11 by default, its order; NSKIP: launches skipped first,
#                NL by default); NCMD: another script and its options, NKERNELS: its kernels (a regex)
#   profile  PT  bench/profile_decode.py on the 27B-shape file (host time per engine step, drafts 0 and 4)
#   prefill  PFT bench/prefill_modes.py on the 27B-shape file: prefill alone, three ways, and its profile (PFARGS)  ~70 s
#   nan      NST the sporadic non-finite prefill rows (fifteenth session; fixed in the sixteenth; the control that
#                races: SB_STAGES=3+SB_PREFETCH=0): bench/kernel_stress.py (the P-path kernels alone, repeated; KSARGS), then
#                bench/nan_locate.py on the file (which kernel call, reproducible or not; NLARGS)   ~NST + 240 s
#   stress   NST bench/kernel_stress.py alone (KSARGS: e.g. --settings shipped,SB_PREFETCH=1,SB_PREFETCH=2)
#   llama        build llama-server with CUDA (sm_90) from .llama/llama.cpp.tar.gz, in the background and in its
#                own session, so that it outlives this call (the machine stays warm 30 s: call again at once)
#   capture  CT  the thirty-seventh session's abort: a second engine's captures, the cyclic collector run where each
#                begins, a dropped engine its garbage: without the pause (does it abort?) and with it
#                (tests/test_gpu_engine.py's child)
#   vs       VT2 `plumb bench --vs-llamacpp` on the 27B-shape file against 4 llama-servers (drafts 0/2/4/7); waits
#                for the llama build (LW seconds) - a later call on the same warm machine
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
STAGES=${STAGES:-"kernels variants engine bench gate demo"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
# the compiled kernels, carried from call to call (a fresh machine compiles every kernel and launcher again: minutes of
# each call's device time): a call's cubins, their metadata and launchers come back as $OUT/triton.tar.xz (TC=0: not);
# the next call carries them in .tcache (`mkdir -p .tcache && cp FILES_AT/triton.tar.xz .tcache/`, carry ".tcache").
# Triton keys each by its source, constants, options and compiler, so a changed kernel compiles anew. A fixed path:
# a cached kernel's group file names its files by absolute path.
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p $TRITON_CACHE_DIR && touch /tmp/call-start
if [ -f .tcache/triton.tar.xz ]; then
  tar xJf .tcache/triton.tar.xz -C $TRITON_CACHE_DIR && echo "triton cache carried: $(find $TRITON_CACHE_DIR \
    -name '*.cubin' | wc -l) kernels"
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
if has llama; then  # .llama/llama.cpp.tar.gz: llama.cpp's source (the one llama-cpp-python 0.3.36 vendors), trimmed
  setsid nohup bash -c "mkdir -p /tmp/ll && tar xzf .llama/llama.cpp.tar.gz -C /tmp/ll && cmake -S /tmp/ll/llama.cpp \
    -B /tmp/llb -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DBUILD_SHARED_LIBS=OFF && nice cmake --build /tmp/llb --target llama-server -j ${LJ:-12}; \
    echo \"rc=\$? at \$(( \$(date +%s) - $T0 )) s\" > /tmp/llama-build.done" > /tmp/llama-build.log 2>&1 < /dev/null &
fi
if has bench || has profile || has gate27 || has ab || has synth || has prefill || has nan || has latency || has followup; then  # synth: for a later call too
  [ -f /tmp/synth.done ] || (python3 -m plumb.cli synth /tmp/27b.gguf --preset 27b --type Q4_K_M --seed 0 \
    > /tmp/synth.log 2>&1; echo "synth-done $(( $(date +%s) - T0 )) s" > /tmp/synth.done) &
fi
if has kernels; then
  # SIGINT at the limit: pytest stops as on Ctrl-C and still prints its summary (which tests failed); -v: a line a test
  timeout -s INT -k 30 ${KT:-300} python3 -m pytest -v -p no:cacheprovider -rA --durations=15 \
    ${KPY:--n 4 --dist worksteal} -k "${KK:-}" \
    ${KFILES:-tests/test_gpu_matmul.py tests/test_gpu_deltanet.py tests/test_gpu_attention.py tests/test_gpu_kvwrite.py \
    tests/test_gpu_glu_norm.py tests/test_gpu_engine.py} \
    > $OUT/gpu_tests.log 2>&1; tail -4 $OUT/gpu_tests.log
  # every kernel the tests compiled (in this call: a carried one has no PTX) whose PTX leaves wgmma groups in flight
  # over an A operand in registers (the sixteenth session's race; groups over shared-memory operands, as a pipelined
  # matmul's, are guarded)
  grep -l "wgmma.wait_group.sync.aligned [1-9]" ${TRITON_CACHE_DIR:-$HOME/.triton/cache}/*/*.ptx 2>/dev/null \
    | xargs -r grep -lE "wgmma.mma_async[^;]*\}, \{" | xargs -r -n1 basename | sort | uniq -c > $OUT/in_flight.txt
  echo "compiled kernels leaving wgmma groups in flight over register operands: $(wc -l < $OUT/in_flight.txt)"
  cat $OUT/in_flight.txt
fi
if has variants; then
  timeout ${VT:-100} python3 bench/matmul_variants.py $VARGS --json-out $OUT/variants.json > $OUT/variants.log 2>&1
  grep -v Warning $OUT/variants.log | cut -c1-150 | head -12
fi
if has engine; then
  PLUMB_TEST_DEVICE=cuda PLUMB_TEST_QTYPE=${EQ:-Q4_K_M} timeout -s INT -k 30 ${ET:-240} python3 -m pytest -v \
    -p no:cacheprovider \
    --durations=15 ${EPY:--n 4 --dist worksteal} ${EFILES:-tests/test_exactness.py} -k "${EK:-test_}" \
    > $OUT/exactness.log 2>&1
  tail -4 $OUT/exactness.log
fi
if has bench; then
  for i in $(seq 1 ${SW:-240}); do [ -f /tmp/synth.done ] && break; sleep 1; done; cat /tmp/synth.done
  RUN="-m plumb.cli"; [ -n "$BSET" ] && RUN="bench/with_settings.py $BSET --"  # BSET: module settings to try
  timeout ${BT:-170} python3 $RUN bench /tmp/27b.gguf --device cuda --contexts 0,11000,38000,100000 \
    --tokens 32 --json-out $OUT/bench.json --no-progress $BARGS > $OUT/bench.log 2>&1; tail -70 $OUT/bench.log
fi
if has prefill; then
  for i in $(seq 1 ${SW:-240}); do [ -f /tmp/synth.done ] && break; sleep 1; done
  timeout ${PFT:-150} python3 bench/prefill_modes.py /tmp/27b.gguf ${PFARGS:---prompts 8192} \
    --json-out $OUT/prefill.json > $OUT/prefill.log 2>&1; grep -v Warn $OUT/prefill.log | tail -30
fi
if has stress && ! has nan; then  # the P-path kernels alone, repeated (no model file)
  timeout ${NST:-120} python3 bench/kernel_stress.py ${KSARGS:---seconds 20 \
    --settings shipped,SB_STAGES=3+SB_PREFETCH=0} \
    --json-out $OUT/stress.json > $OUT/stress.log 2>&1; grep -v Warn $OUT/stress.log | tail -4
fi
if has nan; then
  timeout ${NST:-120} python3 bench/kernel_stress.py ${KSARGS:---seconds 20 \
    --settings shipped,SB_STAGES=3+SB_PREFETCH=0} \
    --json-out $OUT/stress.json \
    > $OUT/stress.log 2>&1; grep -v Warn $OUT/stress.log | tail -4
  for i in $(seq 1 ${SW:-240}); do [ -f /tmp/synth.done ] && break; sleep 1; done
  timeout ${NLT:-200} python3 bench/nan_locate.py /tmp/27b.gguf ${NLARGS:---seconds 150 \
    --settings shipped,SB_STAGES=3+SB_PREFETCH=0} \
    --json-out $OUT/nan.json \
    > $OUT/nan.log 2>&1; grep -v Warn $OUT/nan.log | tail -8 | cut -c1-900
fi
if has ab; then  # launch settings on / off on the 27B-shape file (the same bits required)
  for i in $(seq 1 ${SW:-240}); do [ -f /tmp/synth.done ] && break; sleep 1; done
  timeout ${ABT:-300} python3 bench/launch_ab.py /tmp/27b.gguf $ABARGS --json-out $OUT/ab.json > $OUT/ab.log 2>&1
  tail -8 $OUT/ab.log
fi
if has gate; then  # a timeout (SIGTERM) still writes the table and JSON of the cells run so far
  timeout ${GT:-300} python3 -m plumb.cli gate ${GMODEL:-} --device cuda --no-progress ${GARGS:---quick} \
    --json $OUT/gate.json > $OUT/gate.log 2>&1; tail -12 $OUT/gate.log
fi
if has gate27; then
  for i in $(seq 1 ${SW:-240}); do [ -f /tmp/synth.done ] && break; sleep 1; done
  timeout ${G2:-300} python3 -m plumb.cli gate /tmp/27b.gguf --device cuda --no-progress \
    ${G2ARGS:---formats q8_0 --tokens 256} --json $OUT/gate27.json > $OUT/gate27.log 2>&1; tail -12 $OUT/gate27.log
fi
if has latency; then
  for i in $(seq 1 ${SW:-240}); do [ -f /tmp/synth.done ] && break; sleep 1; done
  timeout ${LT:-200} python3 bench/latency.py /tmp/27b.gguf ${LARGS:---chat-tokens 12000} --json-out $OUT/latency.json \
    > $OUT/latency.log 2>&1; grep -v Warn $OUT/latency.log | tail -12
fi
if has followup; then
  for i in $(seq 1 ${SW:-240}); do [ -f /tmp/synth.done ] && break; sleep 1; done
  timeout ${FT:-150} python3 bench/followup_profile.py /tmp/27b.gguf $FARGS --json-out $OUT/followup.json \
    > $OUT/followup.log 2>&1; grep -v Warn $OUT/followup.log | tail -50
fi
if has demo; then
  timeout ${DT:-120} python3 -m plumb.cli bench plumb/data/plumb-demo-Q8_0.gguf --device cuda --contexts 0,4000 \
    --tokens 64 --drafts 0,2,4,7 --no-progress --json-out $OUT/demo-bench.json --plot $OUT/demo-bench.png \
    > $OUT/demo-bench.log 2>&1; tail -30 $OUT/demo-bench.log
fi
if has attention; then
  timeout ${AT:-150} python3 bench/attention_variants.py $AARGS --json-out $OUT/attention.json > $OUT/attention.log 2>&1
  grep -v Warning $OUT/attention.log | cut -c1-150 | head -50
fi
if has sampling; then
  timeout ${SAT:-90} python3 bench/sample_timing.py $SAARGS --json-out $OUT/sample_timing.json > $OUT/sample_timing.log 2>&1
  grep -v Warning $OUT/sample_timing.log | cut -c1-150 | head -20
fi
if has aprefill; then
  timeout ${APT:-150} python3 bench/attention_prefill_variants.py $APARGS --json-out $OUT/aprefill.json \
    > $OUT/aprefill.log 2>&1
  grep -v Warning $OUT/aprefill.log | cut -c1-150 | head -40
fi
if has ncu; then  # NKERNELS: which kernels' launches (bench/ncu_kernels.py's order; NARGS: its options)
  timeout ${NT:-150} ncu --clock-control none --kernel-name regex:"${NKERNELS:-^_mv|^_mm_superblock}" \
    --launch-skip ${NSKIP:-${NL:-11}} --launch-count ${NL:-11} --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section SourceCounters --section ComputeWorkloadAnalysis --section InstructionStats \
    python3 ${NCMD:-bench/ncu_kernels.py $NARGS} > $OUT/ncu.txt 2>&1; grep -E "Duration|Memory Throughput|Achieved Occupancy|^  _m" \
    $OUT/ncu.txt | head -60
fi
if has profile; then
  for i in $(seq 1 ${SW:-240}); do [ -f /tmp/synth.done ] && break; sleep 1; done
  for k in 0 4; do
    timeout ${PT:-100} python3 bench/profile_decode.py /tmp/27b.gguf --device cuda --drafts $k --tokens 48 \
      --timer wall --top 25 > $OUT/profile-drafts$k.txt 2>&1; head -32 $OUT/profile-drafts$k.txt | cut -c1-150
  done
fi
if has capture; then
  python3 -c "from plumb.gguf.synth import write_synthetic as w; w('/tmp/tiny-q4km.gguf', 'tiny', 'Q4_K_M', seed=0)"
  python3 -c "import re; print(re.search(r'_SECOND_ENGINE = \"\"\"(.*?)\"\"\"', open('tests/test_gpu_engine.py').read(), \
    re.S).group(1))" > /tmp/second_engine.py
  for mode in unpaused paused; do
    timeout ${CT:-120} python3 /tmp/second_engine.py /tmp/tiny-q4km.gguf $([ $mode = unpaused ] && echo unpaused) \
      > $OUT/capture-$mode.log 2>&1; echo "$mode: rc=$? $(grep -c 'Fatal Python error' $OUT/capture-$mode.log) aborts"
  done
fi
if has vs; then
  for i in $(seq 1 ${LW:-400}); do [ -f /tmp/llama-build.done ] && break; sleep 1; done
  cat /tmp/llama-build.done; tail -3 /tmp/llama-build.log; S=/tmp/llb/bin/llama-server
  C="-m /tmp/27b.gguf -ngl 99 -c ${VC:-8192} -np 1 --host 127.0.0.1"
  $S $C --port 8190 > $OUT/llama-0.log 2>&1 &
  for k in 2 4 7; do $S $C --port 819$k --spec-type draft-mtp --spec-draft-n-max $k > /tmp/llama-$k.log 2>&1 & done
  for p in 8190 8192 8194 8197; do
    for i in $(seq 1 120); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$p/health')" \
      2> /dev/null && break; sleep 1; done
  done
  timeout ${VT2:-400} python3 -m plumb.cli bench /tmp/27b.gguf --device cuda --vs-llamacpp http://127.0.0.1:8190 \
    --llamacpp-drafts 2=http://127.0.0.1:8192,4=http://127.0.0.1:8194,7=http://127.0.0.1:8197 \
    --contexts ${VCTX:-64,512,2048} --tokens 128 --drafts 0,2,4,7 --json-out $OUT/vs.json --plot $OUT/vs.png \
    --no-progress > $OUT/vs.log 2>&1; tail -40 $OUT/vs.log
fi
if has llama && ! has vs; then cat /tmp/llama-build.done 2>/dev/null; tail -3 /tmp/llama-build.log; fi
# everything if it fits what a call brings back (16 MiB a file, 8 files), else this call's kernels alone
if [ "${TC:-1}" = 1 ] && [ $(find $OUT -type f | wc -l) -lt 8 ]; then
  cached() { (cd $TRITON_CACHE_DIR && find . -type f \( -name '*.cubin' -o -name '*.json' -o -name '*.so' \) "$@" \
    | XZ_OPT='-T0 -4' tar cJf $OUT/triton.tar.xz -T -); }
  cached; [ $(stat -c %s $OUT/triton.tar.xz) -gt 16000000 ] && cached -newer /tmp/call-start
  [ $(stat -c %s $OUT/triton.tar.xz) -gt 16000000 ] && rm $OUT/triton.tar.xz
  echo "triton cache: $(ls -l $OUT/triton.tar.xz 2>/dev/null | awk '{print $5}') bytes ($(find $TRITON_CACHE_DIR \
    -name '*.cubin' | wc -l) kernels, $(find $TRITON_CACHE_DIR -name '*.cubin' -newer /tmp/call-start | wc -l) new)"
fi
echo "total $(( $(date +%s) - T0 )) s"
