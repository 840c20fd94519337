#!/usr/bin/env bash
# Issue 40's robustness curves on a lent GPU: resume `robustbn tune` of the curves' matrix on CUDA
# in a copy of the store for LIMIT_S seconds, then the tuned files' reporting runs (seeds 0-4) for
# REPORT_S seconds (default 0), then copy the store (gzipped) and the tuned files (one tar: a
# lease returns at most 8 files of 16 MiB) back under ${OUT:-gpu-logs}, and print how many runs
# finished and at what pace. A STORE ending in .gz is unpacked first (the tree that travels is
# capped at 64 MiB). On the CPU machine:
#   gunzip OUT/board.sqlite.gz; robustbn merge --db results/board.sqlite OUT/board.sqlite
#   tar xzf OUT/tuned.tgz -C scenarios/tuned/robustness_fmnist
# A run finished on any device counts (`robustbn tune --device`), so the CPU's lanes resume where
# the GPU stopped. Stopped by SIGTERM at LIMIT_S, tune checkpoints its running runs (on the GPU
# machine, so those few run again). Needs Fashion-MNIST under ROBUSTBN_DATA.
# SEARCH_S > 0: beside the tuning, each curve search that docs/results.md lists as left (its
# "searches left" block, generated from the store) runs in a process of its own for SEARCH_S
# seconds, then its confirmation; the confirmation files come back in the tar (device-free), and a
# search stopped part-way resumes on any machine from the merged store (its finished trial runs
# and those it stopped early are read back; the one it was running runs again). The paces printed count
# each phase's own runs (by their file), though the searches share the GPU with them. The searches
# need Optuna, which the lent machine's image lacks and cannot download: `WHEELS=1 bash
# benchmarks/gpu_curves.sh` here puts its wheels (for the image's Python, PY=3.12) in build/wheels;
# carry that folder, and they are installed under build/pydeps there. Without Optuna the searches
# are skipped, said so, and the rest runs.
#
#   STORE=build/gpu/board.sqlite.gz LIMIT_S=300 REPORT_S=120 SEARCH_S=400 JOBS=8 bash benchmarks/gpu_curves.sh
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${WHEELS:-0}" = 1 ]; then  # on the CPU machine: the wheels the searches need on the GPU machine
  rm -rf build/wheels
  "${PIP:-.venv/bin/pip}" download optuna --python-version "${PY:-3.12}" --only-binary=:all: --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d build/wheels -q || exit 1
  rm -f build/wheels/numpy-*.whl  # the image has its own, built for its torch
  du -sh build/wheels; exit 0
fi
out=${OUT:-gpu-logs}
store=${STORE:?STORE: the store to resume (a copy of results/board.sqlite)}
limit=${LIMIT_S:-300}
report=${REPORT_S:-0}
search=${SEARCH_S:-0}
jobs=${JOBS:-8}
device=${DEVICE:-cuda}  # cpu: a dry run of this script on a machine without a GPU
tuned=scenarios/tuned/robustness_fmnist
mkdir -p "$out"
case "$store" in *.gz) gunzip -kf "$store"; store=${store%.gz} ;; esac
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
finished_here() {  # $1: a GLOB pattern of the runs' file (tuning, tuned files, searches; LIKE's _ is a wildcard)
  python3 -c "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute(\"SELECT COUNT(*) FROM runs WHERE \
status IN ('done', 'diverged') AND device = ? AND source GLOB ?\", sys.argv[2:]).fetchone()[0])" "$store" "$device" "$1"
}
run_search() {  # a line of results.md's searches left: the search, then its confirmation, on the store copy
  local end=$((SECONDS + search)) find confirm rc
  read -ra find <<<"${1%% && *}"
  read -ra confirm <<<"${1#* && }"
  find=("${find[@]/#results\/board.sqlite/"$store"}") confirm=("${confirm[@]/#results\/board.sqlite/"$store"}")
  # python is timeout's own child: SIGTERM reaches it, and it stops checkpointed
  timeout -s TERM -k 30 "$search" python3 -m robustbn.cli "${find[@]:1}" --device "$device" --quiet
  rc=$?
  # rc 1 also means a trial failed although the search ended: its confirmation file tells
  [ -f "${find[-1]}" ] || { echo "gpu_curves: the search wrote no ${find[-1]} (exit $rc)"; return "$rc"; }
  [ $((end - SECONDS)) -gt 0 ] && timeout -s TERM -k 30 $((end - SECONDS)) python3 -m robustbn.cli \
    "${confirm[@]:1}" --device "$device" --quiet
}
tuning_before=$(finished_here '*/tune_*') reporting_before=$(finished_here '*/tuned_*')
searched_before=$(finished_here '*search*')
logs=$(mktemp -d)
searches=()
if [ "$search" -gt 0 ] && ! python3 -c 'import optuna' 2>/dev/null && ls build/wheels/*.whl >/dev/null 2>&1; then
  # a wheel is a zip laid out as site-packages, so no pip is needed there
  python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
    build/pydeps build/wheels/*.whl
  export PYTHONPATH=$PWD/build/pydeps:$PYTHONPATH
fi
if [ "$search" -gt 0 ] && ! python3 -c 'import optuna' 2>/dev/null; then
  echo "gpu_curves: Optuna is missing here, so the curve searches are skipped (carry build/wheels:" \
       "WHEELS=1 bash benchmarks/gpu_curves.sh)"
  search=0
fi
confirmed_before=$(ls "$tuned"/searched_worst_*.toml 2>/dev/null | wc -l)
if [ "$search" -gt 0 ]; then
  while IFS= read -r line; do
    run_search "$line" >"$logs/search_${#searches[@]}.txt" 2>&1 &
    searches+=($!)
  done < <(awk '/^The searches left/ {on = 1} on && /^```/ && ++fences == 2 {exit} on && /^robustbn attack-search /' \
           docs/results.md)
  echo "gpu_curves: ${#searches[@]} curve searches started beside the tuning, for $search s"
fi
start=$SECONDS
lrs=$(python3 -c "import sys; sys.path.insert(0, 'docs'); import tables; print(','.join(map(str, tables.LR_GRID)))")
timeout -s TERM -k 30 "$limit" python3 -m robustbn.cli tune scenarios/robustness_fmnist.toml --grid "lr=[$lrs]" \
  --db "$store" --out "$tuned" --jobs "$jobs" --device "$device" --quiet --first 'norm=[fbn,naive]' >"$out/tune.txt" 2>&1
rc=$?
wall=$((SECONDS - start))
tuned_runs=$(( $(finished_here '*/tune_*') - tuning_before ))
tail -n 5 "$out/tune.txt"
echo "gpu_curves: tune exit $rc; $tuned_runs runs finished on $device in $wall s with $jobs jobs" \
     "($(( tuned_runs * 3600 / (wall > 0 ? wall : 1) )) runs per hour, the start and the stop included)"
if [ "$report" -gt 0 ] && ls "$tuned"/tuned_*.toml >/dev/null 2>&1; then
  start=$SECONDS
  timeout -s TERM -k 30 "$report" python3 -m robustbn.cli run "$tuned"/tuned_*.toml --db "$store" --jobs "$jobs" \
    --device "$device" --quiet >"$out/report.txt" 2>&1
  rc=$?
  wall=$((SECONDS - start))
  echo "gpu_curves: reporting runs exit $rc; $(( $(finished_here '*/tuned_*') - reporting_before )) runs finished" \
       "on $device in $wall s"
fi
if [ ${#searches[@]} -gt 0 ]; then
  wait "${searches[@]}"
  cat "$logs"/search_*.txt >"$out/search.txt"
  echo "gpu_curves: searches done: $(( $(finished_here '*search*') - searched_before )) of their runs finished" \
       "(trials and confirmations); $(( $(ls "$tuned"/searched_worst_*.toml 2>/dev/null | wc -l) - confirmed_before ))" \
       "new confirmation files"
fi
gzip -c "$store" >"$out/board.sqlite.gz"
tar czf "$out/tuned.tgz" -C "$tuned" .
exit 0
