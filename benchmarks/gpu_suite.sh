#!/usr/bin/env bash
# The whole GPU job in one call: environment report and demo, the full test suite (GPU tests
# included), the benchmarks, plan inspection and the seed CNN, and the reliability runs, with logs
# under $OUT (default ./gpu-out), at most 8 files: info.txt, pytest.txt, bench.txt (every benchmark's
# table, in order), plans.txt, reliability.txt (soak and sanitizer output, each stage's summary last),
# and results.tgz with the benchmarks' JSON and the FFT heat map.
#
#   bash benchmarks/gpu_suite.sh [tests|bench|all|soak|sanitize|reliability] [extra pytest args...]
#   BENCH="attention models" PLANS=attention bash benchmarks/gpu_suite.sh bench   # a subset
#   BENCH_QUICK=1 bash benchmarks/gpu_suite.sh bench                              # small shapes (smoke test)
#   JOBS=0 bash benchmarks/gpu_suite.sh tests                                     # the suite serially (default: -n 6)
#   LIBNN_HYPOTHESIS_EXAMPLES=50 bash benchmarks/gpu_suite.sh tests               # fewer property examples (default 200)
#   SOAK_CALLS=1000 bash benchmarks/gpu_suite.sh reliability                      # a shorter soak (default 10000)
#
# Stages: `all` is tests + bench. `reliability` is soak + sanitize, kept out of `all` because it is
# long (the soak runs 10000 calls of each model eagerly and graphed, about 1-2 min on the H100; the
# sanitizer runs the kernel driver under memcheck, racecheck and initcheck, a few minutes): run it as
# a device call of its own. `soak` (benchmarks/soak.py) and `sanitize` (benchmarks/sanitize.sh) run
# one half. Any failing stage makes the exit status 1.
#
# On the lent H100 the carried wheels in .whl/ (nvidia-cudnn-frontend, nvmath-python, and nvidia-cutlass for
# the CUTLASS kernel's headers; see the README) are installed into /tmp/site first, without their
# dependencies, and libnn runs from this working tree. The image's nvcc builds the CUTLASS kernel.
set -uo pipefail
stage=${1:-all}
shift || true
case $stage in
  tests|bench|all|soak|sanitize|reliability) ;;
  *) echo "gpu_suite.sh: unknown stage '$stage'; expected tests, bench, all, soak, sanitize or reliability" >&2; exit 2 ;;
esac
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LIBNN_CACHE_DIR=${LIBNN_CACHE_DIR:-/tmp/libnn-cache}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
status=0
run() {  # run NAME CMD...: append the output to $OUT/NAME.txt and remember a failure
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$OUT/$name.txt"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || status=1
}
run info python3 -m libnn info
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  # pytest-xdist (on the device image) runs the suite in ${JOBS:-6} processes; JOBS=0 runs it serially.
  # worksteal: an idle worker takes tests queued on a busy one, so the long tests do not end the run on
  # one worker while the rest wait. Each worker's NumPy/PyTorch CPU threads are capped at its share of
  # the cores: every float64 reference then no longer runs one thread per core in six processes at once.
  # Serially too, the kernel files compile in background processes while the first tests run
  # (LIBNN_TEST_PRECOMPILE, tests/conftest.py).
  xdist=(); environment=(env LIBNN_TEST_PRECOMPILE=1)
  if [ "${JOBS:-6}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
    xdist=(-n "${JOBS:-6}" --dist worksteal)
    share=$(( $(nproc) / ${JOBS:-6} )); [ "$share" -ge 1 ] || share=1
    environment+=(OMP_NUM_THREADS=$share OPENBLAS_NUM_THREADS=$share MKL_NUM_THREADS=$share)
  fi
  run pytest "${environment[@]}" python3 -m pytest -q -p no:cacheprovider --durations=15 "${xdist[@]}" "$@"
  run info python3 -m libnn demo
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  for op in ${BENCH:-overhead linear conv2d pool2d fft_conv attention argmax models}; do
    run bench python3 -m libnn bench "$op" ${BENCH_QUICK:+--quick} --json "$OUT/bench_$op.json"
  done
  run info python3 -m libnn run cnn --dtype fp16
  for op in ${PLANS:-linear conv2d attention}; do
    case $op in
      linear) run plans python3 -m libnn plans linear --m 8192 --n 16384 --k 4096 --dtype bf16 --activation gelu --time ;;
      conv2d) run plans python3 -m libnn plans conv2d --n 32 --c 64 --h 56 --w 56 --k 64 --r 3 --padding 1 --activation relu --time ;;
      attention) run plans python3 -m libnn plans attention --b 4 --h 16 --s 4096 --d 128 --dtype bf16 --time ;;
    esac
  done
fi
if [ "$stage" = soak ] || [ "$stage" = reliability ]; then
  run reliability python3 benchmarks/soak.py --calls "${SOAK_CALLS:-10000}"
fi
if [ "$stage" = sanitize ] || [ "$stage" = reliability ]; then
  run reliability bash benchmarks/sanitize.sh
fi
if [ -f "$OUT/reliability.txt" ]; then  # each stage's verdict together at the end of the file
  { echo "=== reliability summary"; grep -E '^(soak|sanitize): ' "$OUT/reliability.txt" | grep -vE '^soak: (cnn|encoder)'; } \
    | tee -a "$OUT/reliability.txt"
fi
( cd "$OUT" && results=$(ls | grep -E '[.](json|png)$') && tar czf results.tgz $results && rm -f $results )
exit $status
