#!/usr/bin/env bash
# Every GPU benchmark the issues name, in one device call (docs/benchmarks.md "GPU").
# Usage on the lent machine, after the two staging calls of ../shared/DEVICE.md:
#   export PYTHONPATH=/tmp/site:$PWD && bash scripts/gpu_run.sh $OUT
# Only some steps, e.g.: STEPS=engine,prefix WORDS=1400,2900 LENGTHS=8192,16384 bash scripts/gpu_run.sh $OUT
# Repeats: PREFIX_REPS=2 (each prefix size: cold, repeat, new question per rep), ROUNDS=2 (concurrent rounds,
# the servers in alternating order); VARIANTS=batch8 also runs our server so configured (bench.py --variants)
# Issue 44's GPU targets (8k / 16k / 32k: exact repeat, new question, restore after a restart and its floor, mlx-lm's
# one-cache path and mlx_lm.server, plain mlx-lm's cold prefill, arrays joined per layer), one call of ~8-9 min:
#   STEPS=issue44 bash scripts/gpu_run.sh $OUT
# CPU smoke run (tiny shape, short prompts):  SHAPE=tiny BITS=0 LENGTHS=256,512 WORDS=60 bash scripts/gpu_run.sh /tmp/gpurun
#   (the same for issue 44's steps: STEPS=issue44 SHAPE=tiny BITS=0 LENGTHS=256,512 WORDS=60,120 HIT_TOKENS=512 ...)
# Each step runs under its own time limit (SIGINT, so the scripts stop their servers) and writes
# its figures and log under OUT; a step that runs out of time leaves the others' figures intact.
set -u
out=${1:?usage: gpu_run.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python3}
shape=${SHAPE:-llama3-8b}
bits=${BITS:-4}
lengths=${LENGTHS:-2048,8192,16384}
words=${WORDS:-1400}   # comma-separated prefix sizes, one pair of servers (1400 words ~7.7k tokens, 2900 ~16k)
steps=${STEPS:-engine,ssd_io,prefix,hit_blocks,concurrent,model_threads,models}  # which steps to run
if [ "$steps" = issue44 ]; then  # limits sized for an H100 (docs/benchmarks.md "GPU"); each step alone if short of time
  steps=engine,prefix,hit_blocks
  lengths=${LENGTHS:-8192,16384,32768}
  words=${WORDS:-1400,2900,6000}  # 7.7k, 15.8k, 32.6k tokens with the chat template (the synthetic tokenizer)
  : "${T_ENGINE:=270}" "${T_PREFIX:=60}" "${T_HIT:=45}"  # at most 8.3 min of steps, ~5.5 expected
fi
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  case ",$steps," in *",${name%%_[0-9]*},"*) ;; *) echo "== $name skipped (STEPS)"; return;; esac
  echo "== $name (limit ${secs}s) $(date +%T)"
  local t0=$SECONDS
  timeout -s INT -k 10 "$secs" "$@" > "$out/$name.log" 2>&1
  echo "   rc=$? in $((SECONDS - t0))s"; tail -n 25 "$out/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
# the GPU memory each process holds, every 2 s, to say whose memory ran out if a step fails
(while sleep 2; do nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader \
  2>/dev/null | sed "s/^/$(date +%T), /"; done > "$out/gpu_memory.csv") &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT
$py -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" | tee -a "$out/device.txt"
step engine "${T_ENGINE:-210}" $py scripts/bench_engine.py lengths --shape "$shape" --bits "$bits" \
  --lengths "$lengths" --reps "${REPS:-2}" --out "$out/engine"
step ssd_io "${T_SSD:-40}" $py scripts/bench_engine.py ssd-io --small --out "$out/ssd_io"
model=$(mktemp -d)/m
case ",$steps," in *,prefix,*|*,concurrent,*) ;; *) model=;; esac  # the servers' model folder: written only if used
trap 'kill $sampler 2>/dev/null; [ -z "$model" ] || rm -rf "$(dirname "$model")"' EXIT
[ -z "$model" ] || $py - "$shape" "$bits" "$model" <<'PY' > "$out/model.log" 2>&1
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
from harness.synthetic import synthetic_model
print(synthetic_model(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])))
PY
# every size on one pair of servers (started and warmed up once): the limit is per size
nwords=$(echo "$words" | tr ',' '\n' | grep -c .)
step prefix "$(( ${T_PREFIX:-120} * nwords ))" $py scripts/bench.py --quick --reps "${PREFIX_REPS:-1}" \
  --scenarios system --model "$model" --system-words "$words" --out "$out/prefix"
# a hit's cost against the block size (16 / 64 / 256) on the deep narrow model at 16k tokens (issue 44 item 2)
step hit_blocks "${T_HIT:-60}" $py scripts/bench_engine.py hit-blocks --tokens "${HIT_TOKENS:-16384}" --reps 2 \
  --out "$out/hit_blocks"
step concurrent "${T_CONC:-130}" $py scripts/bench.py --quick --scenarios concurrent --clients ${CLIENTS:-4,8} \
  --rounds "${ROUNDS:-1}" ${VARIANTS:+--variants "$VARIANTS"} --model "$model" --out "$out/concurrent"
step model_threads "${T_THREADS:-60}" $py scripts/features.py model-threads --repeats 3
# a small model's first token while a Llama-3-8B-shaped one prefills 16k tokens: two servers, one process,
# the large one in a process of its own (issue 27)
step models "${T_MODELS:-240}" $py scripts/features.py models --large "$shape" --prefill 16384 --skip-switching \
  --repeats 5 --out "$out/models.json"
echo "== done $(date +%T)"
