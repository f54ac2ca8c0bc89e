#!/usr/bin/env bash
# A/B of the bundle's server before (1fb4907) and after this round, identical work (bench http).
set -u
PY=/work/main/.venv/bin/python
run() {  # run NAME DIR PORT
  local name=$1 dir=$2 port=$3
  (cd "$dir" && BUNDLE_ENABLE_PREFIX_CACHING=true $PY -m shared.serve --port "$port" > /tmp/ab-$name-server.log 2>&1) &
  local pid=$!
  until curl -sf 127.0.0.1:$port/health > /dev/null; do sleep 1; done
  (cd /work/main && $PY -m bench http --url http://127.0.0.1:$port --model tiny --levels 1,8,32,128 --rounds 2 \
     --prompt-tokens 128 --output-tokens 64 --vocab 1000 --repeat 3 --seed 7 --clients 1) > /tmp/ab-$name.txt 2>&1
  pkill -TERM -f "shared.serve --port $port"; wait $pid 2>/dev/null
  sleep 3
}
run after3 /work/main 8305
run before3 /tmp/old-main 8306
