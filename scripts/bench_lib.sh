# Helpers of the benchmark scripts.
#
# bench_build [cmake --build arguments]: builds the tree (scripts/build.sh)
# with its output in a log, printing the log's end if the build fails.
# REQUIRES: $root, the repository.
bench_build() {
  echo "building (scripts/build.sh) ..." >&2
  local log
  log=$(mktemp)
  if ! bash "$root/scripts/build.sh" "$@" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "the build failed (its end above; all of it in $log)" >&2
    return 1
  fi
  rm -f "$log"
}
#
# The benchmarks' one-layer Mixtral-naming model, made once and cached
# (sourced by bench_kernels.sh, bench_router.sh, bench_e2e.sh, bench_hedge.sh).
#   bench_layer NAME TYPE SHAPE_ARGS...   e.g. bench_layer small_layer bf16 --d_model 1024 --d_ff 2816
# synthesizes ${COLIBRI_BENCH_DIR:-$build/bench}/NAME/checkpoint (8 experts,
# top-2, vocab 32000, bf16, 2 shards, seed 1) unless it is there, converts it
# to NAME/TYPE unless that is there, and sets $bench_model to that directory.
# SHAPE_ARGS come last: they may override the defaults (e.g. --top_k 1).
# REQUIRES: $build, the build directory with the tools.
bench_layer() {
  local name=$1 type=$2
  shift 2
  local work=${COLIBRI_BENCH_DIR:-$build/bench}/$name
  mkdir -p "$work"
  if [ ! -f "$work/checkpoint/config.json" ]; then
    "$build/tools/colibri-synth" --out "$work/checkpoint" --naming mixtral --layers 1 --experts 8 \
      --top_k 2 --vocab 32000 --dtype bf16 --shards 2 --seed 1 --overwrite "$@" >/dev/null
  fi
  if [ ! -f "$work/$type/manifest.json" ]; then
    "$build/tools/colibri-convert" --checkpoint "$work/checkpoint" --out "$work/$type" --weight_type "$type" \
      --progress=false --overwrite >/dev/null
  fi
  bench_model=$work/$type
}

# bench_run_figures OUTPUT: "tokens/s|p50 us|p99 us" from `colibri-bench run`'s table output.
bench_run_figures() {
  local tps p50 p99
  tps=$(sed -n 's/^throughput: \([0-9.]*\) tokens\/s.*/\1/p' <<<"$1")
  p50=$(sed -n 's/^latency per layer call (us): p50 \([0-9]*\).*/\1/p' <<<"$1")
  p99=$(sed -n 's/.* p99 \([0-9]*\) .*/\1/p' <<<"$1" | head -1)
  echo "$tps|$p50|$p99"
}
