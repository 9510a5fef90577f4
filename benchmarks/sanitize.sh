#!/usr/bin/env bash
# compute-sanitizer over every custom kernel: benchmarks/sanitize_driver.py (each kernel once, on odd,
# tiny shapes) under memcheck (out-of-bounds and misaligned accesses), racecheck (shared-memory
# hazards) and initcheck (reads of global memory never written). First the driver runs bare, to show
# every item works and which kernels it loads; then once per tool.
#
#   bash benchmarks/sanitize.sh                     # memcheck racecheck initcheck
#   bash benchmarks/sanitize.sh memcheck            # some tools
#   SANITIZER=/path/to/compute-sanitizer ONLY="linear attention" bash benchmarks/sanitize.sh
#
# Prints one summary line per tool ("sanitize: memcheck: 0 errors (exit 0, 41 s)") and a last line;
# exits 1 on any sanitizer error or driver failure, 0 when every tool ran clean. Where no
# compute-sanitizer is found (PATH, /usr/local/cuda*/bin, the nvidia-cuda-sanitizer-api wheel) it says
# so and exits 0 with "sanitize: SKIPPED". API errors that libraries provoke and handle (probing a
# feature) are not reported (--report-api-errors no, where this compute-sanitizer has the option): a
# launch libnn makes that fails raises anyway. SANITIZER_ARGS adds options to every tool's run. Each
# tool's run is limited to SANITIZE_TIMEOUT seconds (default 400).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck initcheck)
python=${PYTHON:-python3}
driver=(benchmarks/sanitize_driver.py ${ONLY:+--only $ONLY})

find_sanitizer() {
  if [ -n "${SANITIZER:-}" ]; then echo "$SANITIZER"; return 0; fi
  command -v compute-sanitizer 2>/dev/null && return 0
  local candidate
  for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
                   /usr/local/cuda*/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer; do
    [ -x "$candidate" ] && { echo "$candidate"; return 0; }
  done
  "$python" - <<'EOF'
import glob, os, site, sys
roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
for root in roots:
    for pattern in ("nvidia/*/compute-sanitizer/compute-sanitizer", "nvidia/*/bin/compute-sanitizer"):
        for candidate in glob.glob(os.path.join(root, pattern)):
            if os.access(candidate, os.X_OK):
                print(candidate)
                sys.exit(0)
sys.exit(1)
EOF
}

sanitizer=$(find_sanitizer) || sanitizer=""
if [ -z "$sanitizer" ]; then
  echo "sanitize: SKIPPED: no compute-sanitizer on PATH, in /usr/local/cuda*/bin or in an nvidia wheel; set SANITIZER=..."
  exit 0
fi
echo "sanitize: $("$sanitizer" --version 2>/dev/null | grep -iE 'version' | head -1) ($sanitizer)"

# API errors that libraries provoke and handle themselves are not ours to report (see the header)
api_errors=()
"$sanitizer" --help 2>/dev/null | grep -q -- '--report-api-errors' && api_errors=(--report-api-errors no)

status=0
summaries=()
start=$SECONDS
echo "=== sanitize: the driver alone"
"$python" "${driver[@]}"
rc=$?
summaries+=("sanitize: driver alone: exit $rc in $((SECONDS - start)) s")
[ "$rc" -eq 0 ] || status=1

log=$(mktemp)
for tool in "${tools[@]}"; do
  echo "=== sanitize: $tool"
  start=$SECONDS
  timeout "${SANITIZE_TIMEOUT:-400}" "$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 20 \
    "${api_errors[@]}" ${SANITIZER_ARGS:-} "$python" "${driver[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  # memcheck/initcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards displayed (N errors, M warnings)"
  summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1)
  errors=$(grep -oE '[0-9]+ errors?' <<<"$summary" | head -1 | grep -oE '[0-9]+')
  note=""
  [ "$rc" -eq 124 ] && note=", timed out after ${SANITIZE_TIMEOUT:-400} s"
  [ -z "$summary" ] && note="$note, no summary line"
  summaries+=("sanitize: $tool: ${errors:-?} errors (exit $rc, $((SECONDS - start)) s$note)${summary:+ | ${summary#========= }}")
  if [ "$rc" -ne 0 ] || [ "${errors:-1}" != 0 ]; then status=1; fi
done
rm -f "$log"
printf '%s\n' "${summaries[@]}"
if [ "$status" -eq 0 ]; then echo "sanitize: clean"; else echo "sanitize: FAILED"; fi
exit $status
