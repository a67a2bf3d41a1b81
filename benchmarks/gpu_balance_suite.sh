#!/usr/bin/env bash
# The balancing placement on two GPUs (one call, < 9.5 min; carry .whl): chat-like goodput, colocated x2 against
# the balanced 1P1D (PD + skip-P + P-alone, decode_balance=1) at the same seeded arrivals, 24 s windows, rates
# around colocated's loose threshold. The robust goodput suite with these defaults (each still overridable).
export WORKLOAD=${WORKLOAD:-chat} CONFIGS=${CONFIGS:-colocated,balanced} RATES=${RATES:-10,12,14}
export DEADLINE_S=${DEADLINE_S:-480}
exec bash benchmarks/gpu_goodput_robust_suite.sh
