#!/usr/bin/env bash
# The Serve path under load, one topology after another: start jobs/serve.py with the given fleet, run
# jobs/bench_serve.py at each request rate, stop the server, go on. One JSON per (topology, rate).
#
#   bash benchmarks/serve_topologies.sh OUT_DIR "RATES" "NUM_PROMPTS INPUT_LEN OUTPUT_LEN" \
#       "name1:overrides..." "name2:overrides..."
#   bash benchmarks/serve_topologies.sh /tmp/out "5 10 20" "400 1000 200" \
#       "dp2:model=llama-3-8b parallel.dp=2 parallel.num_gpus_per_replica=1" \
#       "1p1d:model=llama-3-8b parallel=1p1d parallel.num_gpus_per_replica=1"
#   BENCH_ARGS="--dataset-name spec" bash benchmarks/serve_topologies.sh /tmp/out "8 32" "400 32 128" \
#       "plain:" "ngram-confidence:engine.speculative.method=ngram engine.speculative.schedule=confidence"
# BENCH_ARGS: more arguments of jobs/bench_serve.py (the speculative bench's prompts above: --input-len unused).
set -uo pipefail
out=$1; rates=$2; read -r num_prompts input_len output_len <<< "$3"; shift 3
mkdir -p "$out"
port=8123
rev=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # GIT_REV: when the checkout's git metadata is not the tree that runs
device=cpu
if command -v nvidia-smi > /dev/null; then
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | sed 's/^ *//;s/ /x /' | paste -sd+)
fi
for spec in "$@"; do
  name=${spec%%:*}; overrides=${spec#*:}
  # shellcheck disable=SC2086
  python jobs/serve.py port=$port $overrides > "$out/serve-$name.log" 2>&1 &
  pid=$!
  up() { python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/v1/models', timeout=5)" 2>/dev/null; }
  for _ in $(seq 1 300); do
    up && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  if ! up; then
    echo "$name: the server did not come up"; tail -20 "$out/serve-$name.log"; kill -TERM $pid; wait $pid; continue
  fi
  for rate in $rates; do
    # shellcheck disable=SC2086
    python jobs/bench_serve.py --base-url "http://127.0.0.1:$port" --endpoint completions \
      --num-prompts "$num_prompts" --input-len "$input_len" --output-len "$output_len" --request-rate "$rate" \
      --disable-tqdm ${BENCH_ARGS:-} --json "$out/serve-$name-rate$rate.json" \
      --metadata "topology=$name" "server_overrides=$overrides" "device=$device" "git_rev=$rev" \
      "launcher=bash benchmarks/serve_topologies.sh" > "$out/serve-$name-rate$rate.txt" 2>&1
    python - "$out/serve-$name-rate$rate.json" "$name" "$rate" <<'PY' || tail -5 "$out/serve-$name-rate$rate.txt"
import json, sys
s = json.load(open(sys.argv[1]))
f = lambda k: "/".join(f"{s[k][q]:.0f}" for q in ("median", "p90", "p99"))
print(f"{sys.argv[2]} rate {sys.argv[3]}: ok {s['completed']} failed {s['failed']} out {s['output_throughput']:.0f} tok/s "
      f"req {s['request_throughput']:.2f}/s TTFT med/p90/p99 {f('ttft_ms')} ms TPOT {f('tpot_ms')} ms ITL {f('itl_ms')} ms")
PY
  done
  kill -TERM $pid; wait $pid
  sleep 3  # the embedded Ray goes down with the server process
done
