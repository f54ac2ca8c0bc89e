#!/usr/bin/env bash
# A/B of the bundle's server before issue 15's work (1fb4907) and after it (branch ids),
# identical work (bench http, anonymous streams: the plain streaming path), runs alternated.
# Usage: ab.sh NAME:before|after ...   (e.g. before:before after:after after2:after before2:before)
# Besides the load generator's output, NAME-cpu.txt holds the API process's CPU seconds
# (user + system, engine core excluded) spent serving the load (start-up not counted).
set -u
PY=/work/main/.venv/bin/python
AFTER=/work/wt-ids
BEFORE=/tmp/ab-before  # git worktree add /tmp/ab-before 1fb4907
OUT=${OUT:-/tmp/ab-ids}
mkdir -p "$OUT"
cpu_s() { $PY -c "import psutil, sys; t = psutil.Process(int(sys.argv[1])).cpu_times(); print(t.user + t.system)" "$1"; }
run() {  # run NAME DIR PORT
  local name=$1 dir=$2 port=$3
  (cd "$dir" && BUNDLE_ENABLE_PREFIX_CACHING=true PYTHONPATH="$dir" \
     exec $PY -m shared.serve --port "$port" > "$OUT/$name-server.log" 2>&1) &
  local pid=$!
  until curl -sf 127.0.0.1:$port/health > /dev/null; do sleep 1; done
  local cpu0; cpu0=$(cpu_s "$pid")
  (cd "$AFTER" && $PY -m bench http --url http://127.0.0.1:$port --model tiny --levels 1,8,32,128 --rounds 2 \
     --prompt-tokens 128 --output-tokens 64 --vocab 1000 --repeat 3 --seed 7 --clients 1) > "$OUT/$name.txt" 2>&1
  local cpu1; cpu1=$(cpu_s "$pid")
  $PY -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$cpu0" "$cpu1" > "$OUT/$name-cpu.txt"
  kill -TERM "$pid"; wait "$pid" 2>/dev/null
  sleep 3
}
port=8311
for spec in "$@"; do
  name=${spec%%:*}; side=${spec#*:}
  if [ "$side" = before ]; then run "$name" "$BEFORE" $port; else run "$name" "$AFTER" $port; fi
  port=$((port + 1))
done
