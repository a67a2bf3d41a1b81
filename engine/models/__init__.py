"""The model families and the two forward paths that compute the same thing (the runner picks one at construction).

    base.py            the CausalLM protocol and the per-layer cache views (AttentionCache, StateCache)
    registry.py        config.json + safetensors -> a model; checkpoint.py: random checkpoints; weights_fit.py
    nemotron_h.py      NemotronH (Mamba-2, attention, MLP, MoE blocks); qwen3_5.py: Qwen3.5 (Gated DeltaNet,
                       gated attention)
    mamba2.py          the Mamba-2 mixer; gated_deltanet.py: the Gated-DeltaNet mixer (each with its one reference
                       scan); layers.py: norms, rotary embedding, MLPs, causal conv
    batch.py           the reference path's ForwardBatch and the cache-group views both paths share
    reference.py       the reference path's per-step metadata and paged attention (forward_reference)
    varlen.py          the batched path's per-step metadata (forward_varlen); fast_path.py: its mixers;
                       cuda_graphs.py: its decode steps as CUDA graphs
"""
