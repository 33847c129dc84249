#!/usr/bin/env bash
# Every hand-run figure the README takes from the 16-core GPU host, and the real NVML check, in one
# go on a bare host that has python3 with torch, psutil, nvidia-ml-py and tmux but cannot reach a
# package index. Made here first (network):
#     python -m pip wheel --no-deps -w .whl .      # ranktop itself
#     python -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl \
#         textual rich markdown-it-py mdit-py-plugins linkify-it-py uc-micro-py platformdirs mdurl pygments py-spy regex
# Then there, from the checkout's root:  OUT=DIR bash bench/gpu_host.sh [STEP...]
# Steps, most wanted first: gpu writes launch first tui memory big stacks attach (default: all), each
# bounded in time; their output also goes to $OUT/steps.txt, gpu_check's captures and SVG to $OUT.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
WHEEL=$(ls .whl/ranktop-*.whl)
# Installed (and compiled) as pip leaves them. --installed adds -P to ranktop's command, so that
# the checkout's ranktop/ in the working directory cannot shadow this copy.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
unset PYTHONDONTWRITEBYTECODE
echo "host: $(nproc) cpus, $(python3 --version), torch $(python3 -c 'import torch; print(torch.__version__)'), $(tmux -V)"

step() {  # step NAME SECONDS COMMAND...: one bounded step, its output kept
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/steps.txt"
    echo "== $name: exit ${PIPESTATUS[0]}"
}

for s in ${@:-gpu writes launch first tui memory big stacks attach}; do
    case $s in
        gpu) step gpu 150 python3 -u scripts/gpu_check.py --out "$OUT" ;;
        writes) step writes 90 python3 -u bench/bench_launch.py -s writes -n 5 --no-torchrun --installed "$WHEEL" ;;
        launch) step launch 120 python3 -u bench/bench_launch.py -s many -s trivial -n 5 --installed "$WHEEL" ;;
        first) step first 90 python3 -u bench/bench_first_rank.py --rounds 9 --installed "$WHEEL" ;;
        tui) step tui 110 python3 -u bench/bench_tui.py --cases steady --apps ranktop --seconds 20 --repeats 3 \
                 --installed "$WHEEL" ;;
        memory) step memory 60 python3 -u bench/bench_tui.py --cases memory --apps ranktop --installed "$WHEEL" ;;
        big) step big 90 python3 -u bench/bench_launch.py -s bigline -s mblines -s pty -n 3 --no-torchrun \
                 --installed "$WHEEL" ;;
        stacks) step stacks 40 python3 -u bench/bench_stacks.py ;;
        attach) step attach 100 python3 -u bench/bench_attach.py --installed "$WHEEL" ;;
        *) echo "unknown step $s" ;;
    esac
done
