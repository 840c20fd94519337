#!/usr/bin/env bash
# Issue 40's robustness curves on a CPU machine: two background lanes (a process each, one core
# each) that run what is left, and rerun it as it changes: the tuning (lane 1 an hour at a time,
# lane 2 30 minutes), then the board's searches' tries of the curves' attacks
# (docs/tables.board_try_rows), then the curve searches that the live store lists as left
# (docs/tables.curve_search_rows, half each), then the reporting runs of the tuned files whose lr
# is settled (lane 2; both lanes once the tuning has settled every choice), a few cells at a
# time. Every run lands in the store, so any stop loses at most the runs in flight
# (checkpointed, resumed).
#   bash benchmarks/cpu_lanes.sh start    results/board.sqlite rebuilt from docs/results.csv where
#                                         there is none (robustbn import), then the two lanes
#   bash benchmarks/cpu_lanes.sh freeze   pause both lanes (SIGSTOP): timings and CI on an idle machine
#   bash benchmarks/cpu_lanes.sh thaw     resume them
#   bash benchmarks/cpu_lanes.sh stop     end them after the command each is running
#   bash benchmarks/cpu_lanes.sh halt     end them now (the runs in flight resume from their checkpoints)
#   bash benchmarks/cpu_lanes.sh status   what each lane runs, and the store's runs by status
#   bash benchmarks/cpu_lanes.sh commands N   what lane N would run now
# The lanes run a snapshot of the code ($Q/src, taken at start): edits and pulls here do not reach a
# process halfway through its imports. Logs in $Q (default /tmp/lanes).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
Q=${Q:-/tmp/lanes}
DB=results/board.sqlite
PY=$root/.venv/bin/python

lane_commands() {  # lane N's commands, a line each, from the live store
  ROBUSTBN_DOCS_RUNS=$root/$DB OMP_NUM_THREADS=1 "$PY" - "$1" <<'PY'
import sys
sys.path.insert(0, "docs")
import tables

lane = int(sys.argv[1])
tune = (f"robustbn tune {tables.ROBUSTNESS_MATRIX} {tables.GRID_OPTION} --db results/board.sqlite "
        f"--out {tables.TUNED_DIR} --first 'norm=[fbn,naive]' --quiet")
# the tuning first: a search or a reporting run at a point whose lr then moves is spent for nothing
print(f"timeout -s TERM {3600 if lane == 1 else 1800} {tune}")
# the board's searches try the curves' confirmed attacks: few runs, and they can turn a board verdict
for line in tables.board_try_rows()[1][lane - 1::2]:
    print(line)
for line in tables.curve_search_rows()[1][lane - 1::2]:
    print(line)
unsettled = tables.unsettled_points()
protocols = ("fbn", "naive", "fixbn")  # seed 002's comparison first, as the tuning's --first
# the root-free defenses first, every protocol's: they complete the map's picks and the root-free protocol
# comparison (the trusted defense is alone in its model); point by point, so that each cell completes (and its
# search can start) before the next begins
first = lambda item: ("fltrust" in item[0][1], protocols.index(item[0][0]) if item[0][0] in protocols
                      else len(protocols), item[0][2], item[0][3], item[1])
settled = [(first(item)[:4], item[1]) for item in sorted(tables.tuned_points().items(), key=first)
           if item[0] not in unsettled]
# the tuned files whose lr the tuning has settled: lane 2's, and lane 1's too once nothing is left to tune
# (the same list in the same order: each run is claimed in the store by one lane, the other skips it). The first
# cells with runs left, about 6 files (two root-free cells, six trusted ones) a command: the lane then lists again,
# so that the search of a cell just completed starts within about a cell's time, not after every file (a lane done
# with the first cell goes on to the next while the other finishes its last runs of the first)
cells, files = [], 0
for cell in dict.fromkeys(cell for cell, path in settled if not tables.all_finished(path)):
    if files >= 6:
        break
    cells.append(cell)
    files += sum(1 for c, _ in settled if c == cell)
if cells and (lane == 2 or not unsettled):
    print(f"robustbn run {' '.join(path for cell, path in settled if cell in cells)} --db results/board.sqlite "
          f"--quiet --yes")
PY
}

lane() {
  local n=$1
  while [ ! -e "$Q/stop" ]; do
    lane_commands "$n" >"$Q/cmd$n" 2>>"$Q/lane$n.err" || { sleep 60; continue; }
    while IFS= read -r line <&3; do
      [ -e "$Q/stop" ] && break
      echo "$(date -u +%FT%TZ) START $line" >>"$Q/lane$n.log"
      # `robustbn` (and `timeout ... robustbn`) as the snapshot's; the working tree stays the cwd
      bash -c "${line//robustbn /env PYTHONSAFEPATH=1 PYTHONPATH=$Q/src OMP_NUM_THREADS=1 $PY -m robustbn.cli }" \
        >>"$Q/lane$n.out" 2>&1
      echo "$(date -u +%FT%TZ) END rc=$?" >>"$Q/lane$n.log"
    done 3<"$Q/cmd$n"
    sleep 30
  done
}

case ${1:-status} in
  start)
    mkdir -p "$Q"
    [ -s "$DB" ] || { mkdir -p results && "$PY" -m robustbn.cli import docs/results.csv --db "$DB"; } || exit 1
    rm -rf "$Q/src" "$Q/stop" && git clone -q "$root" "$Q/src" || exit 1
    for n in 1 2; do
      setsid bash "$0" lane "$n" >/dev/null 2>&1 &
      echo $! >"$Q/lane$n.pid"
    done
    echo "cpu_lanes: two lanes started (code at $(git -C "$Q/src" log --oneline -1)); logs in $Q" ;;
  lane) lane "$2" ;;
  commands) lane_commands "${2:-1}" ;;
  freeze|thaw)
    signal=$([ "$1" = freeze ] && echo STOP || echo CONT)
    for n in 1 2; do  # the lane's whole session (setsid): its shell, its command, `timeout`'s own group, workers
      [ -s "$Q/lane$n.pid" ] && pkill -"$signal" -s "$(cat "$Q/lane$n.pid")" && echo "lane $n: $1"
    done ;;
  stop) mkdir -p "$Q" && touch "$Q/stop"; echo "cpu_lanes: each lane ends after its current command" ;;
  halt)  # now: each lane's whole session ended (a frozen one thawed to take the signal); its runs in flight
         # were checkpointed and resume at the next start
    mkdir -p "$Q" && touch "$Q/stop"
    for n in 1 2; do
      [ -s "$Q/lane$n.pid" ] || continue
      pkill -TERM -s "$(cat "$Q/lane$n.pid")"; pkill -CONT -s "$(cat "$Q/lane$n.pid")"
    done
    for _ in $(seq 120); do  # a stopped tune writes the choices its last runs settled: wait for it (an export follows)
      alive=0
      for n in 1 2; do [ -s "$Q/lane$n.pid" ] && pgrep -s "$(cat "$Q/lane$n.pid")" >/dev/null && alive=1; done
      [ $alive = 0 ] && break
      sleep 1
    done
    echo "cpu_lanes: both lanes ended; the runs they left resume at the next start" ;;
  status)
    for n in 1 2; do echo "lane $n: $(tail -n 1 "$Q/lane$n.log" 2>/dev/null | cut -c1-160)"; done
    "$PY" -c "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); print(dict(c.execute(
        'SELECT status, COUNT(*) FROM runs GROUP BY status')))" "$DB" ;;
  *) echo "usage: bash benchmarks/cpu_lanes.sh start|freeze|thaw|stop|halt|status|commands N" >&2; exit 2 ;;
esac
