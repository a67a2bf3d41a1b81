"""The correctness reference: `transformers`' own implementation on the same checkpoint, greedy.

`hf_greedy` is greedy decoding by full recomputation (no cache: transformers' plainest path). Computed fast and
exactly: transformers' own cached `generate` proposes the tokens, then ONE uncached forward over prompt + proposal
gives the logits at every position (a causal model's logits at t depend only on tokens <= t); each proposed token
must be that forward's argmax, and its log-softmax is the reference logprob. Where the proposal is not the argmax
(transformers' cached path drifts from its uncached one by ~1e-4 after a few dozen steps: seen here), decoding
continues by uncached recomputation from that step.
"""

from __future__ import annotations

import functools
import itertools

import torch


def _torch_only_modeling() -> None:
    """transformers binds Qwen3.5's Gated DeltaNet to fla-core's Triton kernels when fla-core is installed (as on
    the GPU box, where the engine itself uses it). The reference must be transformers' own torch code, as on CPU in
    CI, not the library under test: rebind the module's kernel entry points to the torch functions they wrap. (On
    the H200, transformers' fla-core path sat 2.4-6.5e-4 from the engine's fp32 logprobs, and it cannot run in
    float64.) The same for Qwen3.5-MoE's copy; and MoE experts through transformers' eager loop, not its grouped
    GEMMs."""
    import importlib
    import inspect

    for module, name in itertools.product(("qwen3_5", "qwen3_5_moe"),
                                          ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")):
        try:  # each family's modeling file binds its own copy
            qwen = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        except ImportError:
            continue
        fn = getattr(qwen, name, None)
        if fn is None or getattr(fn, "_torch_only", False):
            continue
        inner = inspect.unwrap(fn)
        params = set(inspect.signature(inner).parameters)

        def torch_only(*args, _inner=inner, _params=params, **kwargs):  # type: ignore[no-untyped-def]
            return _inner(*args, **{k: v for k, v in kwargs.items() if k in _params})

        torch_only._torch_only = True  # type: ignore[attr-defined]
        setattr(qwen, name, torch_only)


@functools.lru_cache(maxsize=4)
def hf_model(path: str, dtype: str = "float32", device: str = "cpu"):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    _torch_only_modeling()

    kwargs = {"dtype": getattr(torch, dtype), "attn_implementation": "eager"}
    try:  # transformers without the option (< 5.x) has only the eager experts loop
        model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kwargs)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to(device).eval()


@torch.inference_mode()
def _uncached_logprobs(model, ids: list[int], device: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    x = torch.tensor([ids], device=device)
    return torch.log_softmax(model(x, use_cache=False).logits[0].float(), dim=-1)


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, dtype: str = "float32", device: str = "cpu"):
    """Greedy continuation under transformers' uncached forward: (tokens, chosen-token logprobs)."""
    model = hf_model(path, dtype, device)
    ids = torch.tensor([prompt], device=device)
    proposal = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )[0, len(prompt):].tolist()
    tokens: list[int] = []
    logprobs: list[float] = []
    while len(tokens) < max_new_tokens:
        rest = proposal[len(tokens):max_new_tokens]
        lp = _uncached_logprobs(model, prompt + tokens + rest[:-1], device)
        for step in range(len(tokens), max_new_tokens):
            pos = len(prompt) + step - 1
            if pos >= lp.shape[0]:
                break
            best = int(torch.argmax(lp[pos]))
            tokens.append(best)
            logprobs.append(float(lp[pos, best]))
            if step >= len(proposal) or best != proposal[step]:
                proposal = tokens[:]  # diverged (or no proposal left): recompute step by step from here
                break
    return tokens, logprobs


def hf_greedy_uncached(path: str, prompt: list[int], max_new_tokens: int, dtype: str = "float32",
                       device: str = "cpu") -> tuple[list[int], list[float]]:
    """Greedy continuation by one uncached transformers forward per token: for models whose `generate` cannot
    run (transformers' cache needs an attention layer to report its length)."""
    model = hf_model(path, dtype, device)
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        last = _uncached_logprobs(model, prompt + tokens, device)[-1]
        best = int(torch.argmax(last))
        tokens.append(best)
        logprobs.append(float(last[best]))
    return tokens, logprobs


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@functools.lru_cache(maxsize=16)
def reference_set(path: str, lengths: tuple[int, ...], new_tokens: int, seed: int = 1):  # type: ignore[no-untyped-def]
    """(prompts, [(tokens, logprobs)]) for random prompts of `lengths`; cached for the whole test session, so test
    modules asking for the same reference share one transformers run. Callers must not mutate the lists."""
    prompts = random_prompts(list(lengths), vocab=256, seed=seed)
    return prompts, [hf_greedy(path, p, new_tokens) for p in prompts]


@torch.inference_mode()
def score_under(truth_model, prompts: list[list[int]], runs, device: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Each run's own greedy tokens scored under `truth_model` (teacher-forced, uncached): per chosen token,
    |its logprob - the truth's logprob of that token|, and where the truth would have chosen another token, the
    truth's margin between the two (a near-tie flips by rounding alone; a real error flips with a large margin).
    `runs`: [(tokens, logprobs)] per prompt. Returns max / mean / median error, flips and the largest margin."""
    errs: list[float] = []
    margins: list[float] = []
    for p, (toks, lps) in zip(prompts, runs, strict=True):
        lp = _uncached_logprobs(truth_model, p + list(toks[:-1]), device)
        for step, (t, mine) in enumerate(zip(toks, lps, strict=True)):
            row = lp[len(p) + step - 1]
            errs.append(abs(mine - float(row[t])))
            best = int(torch.argmax(row))
            if best != t:
                margins.append(float(row[best] - row[t]))
    errs.sort()
    return {"max_lp_err": errs[-1], "mean_lp_err": sum(errs) / len(errs), "p50_lp_err": errs[len(errs) // 2],
            "non_argmax": float(len(margins)), "max_margin": max(margins, default=0.0), "tokens": float(len(errs))}
