#!/usr/bin/env bash
# The H200 measurements, in the order the issues need them; each writes its result files under
# ${OUT:-benchmarks/results}. Needs gin-config and grain (and fla-core for the KDA anchor) installed
# beside the image's JAX; run from the repository root. Each KDA step fits one 10-minute command. Pass step names to run
# a subset:
#   bash benchmarks/h200.sh kda attn_res
set -u
OUT=${OUT:-benchmarks/results}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(kda kda_model attn_res_kernel attn_res attention memory long_context)
for step in "${steps[@]}"; do
  echo "== $step"
  case $step in
    kda)  # all four shapes, both gates, flash-linear-attention timed in the same run (first: its autotuning, ~250 s),
      # the bounded kernels also with the open candidates; about 9 minutes
      python3 -m experiments.bench_kda --fla_first --repeats=20 \
        --shapes=4x8192x16x128,1x32768x16x128,1x8192x16x128,1x131072x16x128 \
        --variants=fla_bounded,fla_unbounded,pallas_bounded,pallas_unbounded --tuned=pallas_bounded \
        --tunings="base;cumulative_gates=1,fused_outputs=1,scan_lookahead=1" --fla_timeout=330 --deadline_s=540 \
        --out_dir="$OUT" ;;
    kda_xla)  # the chunked XLA path (the correctness reference, tens of ms), in its own folder
      python3 -m experiments.bench_kda --repeats=10 --xla_repeats=3 --variants=xla_bounded,xla_unbounded \
        --deadline_s=500 --out_dir="$OUT/kda_xla" ;;
    kda_ablate)  # where the bounded scores kernel's time goes, and the open forward candidates, by CUDA events
      (python3 -m experiments.ablate_kda_scores --shape=4x8192x16x128 &&
       python3 -m experiments.ablate_kda_scores --shape=1x32768x16x128) | tee "$OUT/kda_ablate_h200.txt" ;;
    kda_candidates)  # the open candidates (Tuning.cumulative_gates, fused_outputs, scan_lookahead) one at a time
      # against the defaults, then every bar with all three
      python3 -m experiments.bench_kda --repeats=20 --variants=pallas_bounded --deadline_s=300 \
        --tunings="base;cumulative_gates=1;fused_outputs=1;scan_lookahead=1" --out_dir="$OUT/kda_candidates" &&
      python3 -m experiments.verify_kda --tuning=cumulative_gates=1,fused_outputs=1,scan_lookahead=1 \
        --out="$OUT/kda_verify_candidates_h200.txt" ;;
    kda_model)  # whole-model losses, Pallas vs XLA KDA
      python3 -m experiments.compare_kda_backends --steps=20 --out="$OUT/kda_model_check_h200" ;;
    attn_res_kernel)  # the fused AttnRes mix against XLA on the GPU, then per-site timings
      python3 -m experiments.verify_attn_res --tune --out="$OUT/attn_res_kernel_h200" ;;
    attn_res)  # residual-mode step time and memory, 16 layers
      python3 -m experiments.bench_attn_res --d_model=512 --heads=4 --seq_len=2048 --batch=4 \
        --dtype=bfloat16 --remats=none --experts=16 --rounds=10 --kda_backend=pallas \
        --out_dir="$OUT" --tag=h200 ;;
    attention)  # cuDNN MLA attention: packed-document isolation against XLA, then timings
      python3 -m experiments.verify_attention --seq_lens=1024,8192 --time_lens=8192,32768,131072 \
        --out="$OUT/mla_cudnn_h200" ;;
    memory)  # compiled temporaries per token of each sublayer and of the 1M step (compile only)
      python3 -m experiments.memory_sublayers --lengths=16384,65536 --model_lengths=65536,1048576 \
        --out="$OUT/memory_h200" ;;
    long_context)  # small_h200.gin forward+backward at 8K, 64K, 256K, 1M
      python3 -m experiments.bench_long_context --out="$OUT/long_context_h200" ;;
    *) echo "unknown step $step (kda, kda_xla, kda_ablate, kda_candidates, kda_model, attn_res_kernel, attn_res, attention, memory, long_context)"; exit 2 ;;
  esac
done
