"""Tensor parallelism inside one worker: one process per rank (GPU), every rank holding a head slice of every
layer and of every cache page and state.

    group.py     the process group (gloo on CPU, NCCL plus a gloo control group on CUDA), rank helpers, reductions
    layers.py    row-parallel reduce, vocab-parallel embedding and LM head (logits gathered on every rank)
    shard.py     cutting a loaded model to one rank's slice (attention / Mamba-2 / Gated DeltaNet heads, MLPs,
                 MoE experts) and the per-rank `args` its cache specs are computed from
    executor.py  rank 0 runs the EngineCore and broadcasts each runner call; followers execute it
"""
