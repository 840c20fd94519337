#!/usr/bin/env bash
# Every CUDA check and measurement of docs/performance.md, for a GPU machine whose python3
# already has torch, numpy, scipy, matplotlib, tqdm, pytest and hypothesis: nothing is
# installed, the checkout runs as it is (PYTHONPATH). One log per part under ${OUT:-gpu-logs}.
#
#   bash benchmarks/gpu.sh [tests] [round] [capture] [scale] [aggregators] [checkpoint] [matrix] [shared] [pool]   (default: all)
#
# Sized for a 15-minute lease: the caps add up to 13.5 minutes (all parts but capture and shared
# took 3.5 on one H100, 2026-11-27; capture about 0.5; shared and pool are new, 2026-11-28), and each part
# is stopped after its own cap (seconds; GPU_SH_CAP_<PART>=N changes one, 0 removes it), so one
# slow part cannot eat the others' time. The benchmarks print as they go, so a stopped part keeps what it
# measured. Parts run in order of what matters most: correctness first.
#
# Fashion-MNIST: point ROBUSTBN_DATA at a folder with its four .gz files (else the benchmarks
# fall back to synthetic images, and matrix.py, which needs the real data, is skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null || { echo "gpu.sh: python3 has no torch that sees a CUDA device" >&2; exit 2; }
have_fmnist() { [ -n "${ROBUSTBN_DATA:-}" ] && ls "$ROBUSTBN_DATA"/train-images-idx3-ubyte* >/dev/null 2>&1; }
declare -A cap=([tests]=120 [round]=90 [capture]=60 [scale]=90 [aggregators]=70 [checkpoint]=30 [matrix]=80 [shared]=150 [pool]=120)

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, platform; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', platform.python_version(), torch.cuda.get_device_name())"
  nproc; } 2>&1 | tee "$out/machine.txt"

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests round capture scale aggregators checkpoint matrix shared pool)
status=0
for part in "${parts[@]}"; do
  [ -n "${cap[$part]+x}" ] || { echo "gpu.sh: unknown part '$part' (tests, round, capture, scale, aggregators, checkpoint, matrix, shared, pool)" >&2; exit 2; }
  var=GPU_SH_CAP_${part^^}; limit=${!var:-${cap[$part]}}
  stop=(); [ "$limit" != 0 ] && stop=(timeout -k 5 "$limit")
  echo "== $part (cap ${limit}s)" >&2
  start=$SECONDS
  case "$part" in
    tests) "${stop[@]}" python3 -m pytest -q -p no:cacheprovider -k cuda tests ;;
    round) "${stop[@]}" python3 benchmarks/round.py --device cuda --repeats 10 ;;
    capture) "${stop[@]}" python3 benchmarks/capture.py --no-compile ;;
    scale) "${stop[@]}" python3 benchmarks/scale.py --device cuda --algorithms dsgd fedavg --n 10 100 1000 ;;
    aggregators) "${stop[@]}" python3 benchmarks/aggregators.py --device cuda --n 10 100 ;;
    checkpoint) "${stop[@]}" python3 benchmarks/checkpoint.py --device cuda ;;
    matrix) if have_fmnist; then "${stop[@]}" python3 benchmarks/matrix.py --device cuda --set rounds=100 --every 5 --limit 8 --jobs 1 4
            else echo "matrix: skipped, ROBUSTBN_DATA has no Fashion-MNIST"; fi ;;
    shared) "${stop[@]}" bash -c "python3 benchmarks/shared_gpu.py --device cuda --procs 1 8 --rounds 20 --rules dnc \
              --bn-attacks bn-kl --eigh host cusolver; exec python3 benchmarks/shared_gpu.py --device cuda --procs 1 8 \
              --rounds 20 --rules nnm+trmean --bn-attacks bn-kl" ;;
    pool) if have_fmnist; then "${stop[@]}" python3 benchmarks/pool.py --device cuda --jobs 8 --files 4 --runs 8 \
              --rounds 150 --repeats 1
          else echo "pool: skipped, ROBUSTBN_DATA has no Fashion-MNIST"; fi ;;
  esac 2>&1 | tee "$out/$part.txt"
  rc=${PIPESTATUS[0]}
  echo "== $part: exit $rc after $((SECONDS - start)) s$(case $rc in 124|137) echo ", stopped at its cap";; esac)" | tee -a "$out/$part.txt" >&2
  [ "$rc" = 0 ] || status=1
done
exit $status
