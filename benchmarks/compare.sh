#!/usr/bin/env bash
# Before/after benchmarks in one GPU call: `libnn bench <op> --quick` for a baseline tree and for this
# working tree, alternated (before, after, before, after, ...) so that run-to-run noise on the same code
# shows beside any change, then one table: each case's median GPU time before and after, the ratio, and
# the spread between runs of the same tree. PyTorch's rows change with neither tree: they are the control.
#
#   git archive <BASE> -o .whl/base.tar                  # here (.whl/ is git-ignored and carried)
#   bash benchmarks/compare.sh .whl/base.tar             # on the device, from the repository root
#   OPS="linear conv2d" ROUNDS=3 bash benchmarks/compare.sh .whl/base.tar
#   bash benchmarks/compare.sh .whl/base.tar .whl/head.tar   # two archived trees (head in /tmp/head)
#   bash benchmarks/compare.sh --table DIR               # only the table, from DIR's JSON files
#
# The baseline is extracted to /tmp/base and run from there (with `python3 -m`, the current directory
# comes first on sys.path, so each tree runs from its own root); each tree keeps its own libnn cache
# directory. Where a tree's CLI has an older name for an op's benchmark (conv for conv2d), that name is
# used. Results go to $OUT (default ./gpu-out): compare/<tree>_<op>_<round>.json and .log (a run's
# results and its output; tree is base or head), and the table in compare.txt. The carried wheels in
# .whl/ are installed into /tmp/site first, as benchmarks/gpu_suite.sh does. A failed run is reported
# and skipped; the exit status is then 1.
set -uo pipefail

table() {  # table DIR: one row per case found in DIR/{base,head}_<op>_<round>.json
  python3 - "$1" <<'EOF'
import glob, json, math, os, re, statistics, sys

# Row fields that are measurements, not part of what identifies a case; fields ending in "/x" are
# ratios to another path of the same run.
MEASURED = {"ms", "per-call ms", "TFLOP/s", "%ceil", "GB/s", "note", "host_us"}

def case_key(row):
    return tuple((k, str(v)) for k, v in row.items()
                 if k not in MEASURED and not k.endswith("/x") and not isinstance(v, float))

runs = {}  # (op, key) -> {"base": {"ms": [...], "per-call ms": [...]}, "head": {...}}
order = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    m = re.fullmatch(r"(base|head)_(.+)_(\d+)\.json", os.path.basename(path))
    if not m:
        continue
    tree, op = m.group(1), m.group(2)
    with open(path) as f:
        rows = json.load(f).get("rows", [])
    for row in rows:
        ident = (op, case_key(row))
        if ident not in runs:
            runs[ident] = {"base": {}, "head": {}}
            order.append(ident)
        for field in ("ms", "per-call ms"):
            value = row.get(field)
            if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
                runs[ident][tree].setdefault(field, []).append(value)

def med(values):
    return statistics.median(values) if values else None

def spread(values):  # (max - min) / min between runs of one tree
    return (max(values) - min(values)) / min(values) if len(values) > 1 else None

def fmt(v, digits=4):
    return "-" if v is None else f"{v:.{digits}g}"

header = ["op", "case", "before ms", "after ms", "after/before", "spread", "beyond spread",
          "per-call after/before"]
lines, ratios = [], {}
for op, key in order:
    sides = runs[(op, key)]
    b, a = sides["base"].get("ms", []), sides["head"].get("ms", [])
    ratio = med(a) / med(b) if a and b else None
    noise = max((s for s in (spread(b), spread(a)) if s is not None), default=None)
    beyond = "" if ratio is None or noise is None else ("yes" if abs(ratio - 1) > noise else "")
    pb, pa = sides["base"].get("per-call ms", []), sides["head"].get("per-call ms", [])
    per_call = med(pa) / med(pb) if pa and pb else None
    label = " ".join(v for k, v in key if v not in ("", "None"))
    lines.append([op, label, " ".join(fmt(v) for v in b) or "-", " ".join(fmt(v) for v in a) or "-",
                  fmt(ratio, 3), "-" if noise is None else f"{100 * noise:.1f}%", beyond, fmt(per_call, 3)])
    if ratio is not None:
        group = "torch (control)" if "torch" in label else "libnn"
        ratios.setdefault((op, group), []).append(ratio)

widths = [max(len(r[i]) for r in [header] + lines) for i in range(len(header))]
print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
print("  ".join("-" * w for w in widths))
for r in lines:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
print()
print("after/before: the ratio of the medians over runs (below 1: faster after); spread: the larger of the")
print("two trees' (max - min) / min between their own runs; beyond spread: the change exceeds it;")
print("-: no time (a path that declined the case, or a case only one tree's benchmark has).")
for (op, group), values in sorted(ratios.items()):
    geo = math.exp(sum(math.log(v) for v in values) / len(values))
    print(f"{op} {group}: geometric mean after/before {geo:.3f} over {len(values)} cases")
EOF
}

if [ "${1:-}" = --table ]; then
  [ -d "${2:-}" ] || { echo "compare.sh: --table takes a folder of JSON results" >&2; exit 2; }
  table "$2"
  exit
fi
base_tar=${1:-} head_tar=${2:-}
if [ -z "$base_tar" ] || [ ! -f "$base_tar" ] || { [ -n "$head_tar" ] && [ ! -f "$head_tar" ]; }; then
  echo "compare.sh: usage: bash benchmarks/compare.sh BASE.tar [HEAD.tar] (from git archive), or --table DIR" >&2
  exit 2
fi

OUT=${OUT:-$PWD/gpu-out}
dir=$OUT/compare
mkdir -p "$dir"
head=$PWD base=/tmp/base
rm -rf "$base" && mkdir -p "$base" && tar -xf "$base_tar" -C "$base" || exit 1
if [ -n "$head_tar" ]; then
  head=/tmp/head
  rm -rf "$head" && mkdir -p "$head" && tar -xf "$head_tar" -C "$head" || exit 1
fi
site=
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  site=/tmp/site:
fi
export PYTHONUNBUFFERED=1

command_name() {  # command_name TREE OP: the name TREE's CLI gives OP's benchmark
  local tree=$1 op=$2
  if [ ! -f "$tree/libnn/bench/$op.py" ]; then
    case $op in conv2d) op=conv ;; fft_conv) op=fftconv ;; esac
  fi
  echo "$op"
}

status=0
for op in ${OPS:-linear conv2d attention}; do
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for tree in base head; do
      root=${!tree}
      name=$(command_name "$root" "$op")
      run=$dir/${tree}_${op}_${round}
      start=$SECONDS
      ( cd "$root" && PYTHONPATH=$site$root LIBNN_CACHE_DIR=/tmp/libnn-cache-$tree \
          python3 -m libnn bench "$name" --quick --json "$run.json" ) >"$run.log" 2>&1
      rc=$?
      echo "=== $tree round $round: bench $name exit $rc in $((SECONDS - start)) s"
      if [ "$rc" -ne 0 ]; then
        status=1
        rm -f "$run.json"
        tail -n 5 "$run.log"
      fi
    done
  done
done
table "$dir" | tee "$OUT/compare.txt"
exit $status
