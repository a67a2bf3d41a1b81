"""What the memory holds, in numbers: the GPU's cache budget (vLLM's gpu_memory_utilization meaning) and the
start-up error of a model that cannot fit.

    share  = gpu_memory_utilization x total GPU memory     (must be free: other processes' memory is not taken)
    budget = share - weights - activation reserve of a max-size step - the TP all-reduce's exchange buffer
    fits   = the budget holds one request of max_model_len: its recurrent states + its attention KV blocks

A model that cannot fit names every term: the share, weights, activation reserve, cache per token and per
request, the max concurrency at max_model_len (0) and the largest max_model_len the budget would hold."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridpd.engine.errors import InvalidRequestError


def fmt_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps a digit before the point: 1.5 GiB, 20.5 KiB, 256 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class GpuBudget:
    """How the cache budget of one GPU was derived (for the start-up log and errors)."""

    total: int
    share: int
    weights: int
    activation: int
    utilization: float
    exchange: int = 0
    """The fused all-reduce's exchange buffer (tensor parallelism; outside the caching allocator's counts)."""

    @property
    def cache(self) -> int:
        return self.share - self.weights - self.activation - self.exchange

    def note(self) -> str:
        exchange = f", the all-reduce exchange buffer {fmt_bytes(self.exchange)}" if self.exchange else ""
        return (
            f"; of the {fmt_bytes(self.share)} share of the GPU (gpu_memory_utilization {self.utilization:g} of "
            f"{fmt_bytes(self.total)}), weights take {fmt_bytes(self.weights)}{exchange} and activations are "
            f"reserved {fmt_bytes(self.activation)}"
        )


def gpu_budget(
    total: int, free: int, reserved: int, weights: int, utilization: float, activation: int, exchange: int = 0
) -> GpuBudget:
    """The cache budget on a GPU with `total` bytes, `free` of them free and `reserved` held by this process's
    allocator (counted as free: they are ours). InvalidRequestError when the share is not free."""
    share = int(utilization * total)
    if share > free + reserved:
        raise InvalidRequestError(
            f"gpu_memory_utilization={utilization:g} asks for {fmt_bytes(share)} of the GPU's {fmt_bytes(total)}, "
            f"but only {fmt_bytes(free + reserved)} is free (other processes hold the rest): lower "
            f"--gpu-memory-utilization (gpu_memory_utilization; workers sharing one GPU each need their part, e.g. "
            f"0.45 for two) or free the GPU"
        )
    return GpuBudget(total, share, weights, activation, utilization, exchange)


def require_cache_room(nbytes: int, total: int, free: int, reserved: int, allocated: int) -> None:
    """InvalidRequestError when an explicit cache size (--kv-cache-memory-bytes, which replaces the
    gpu_memory_utilization share) is more than the GPU has free: `free` by the driver plus what this process's
    allocator holds unused (`reserved` - `allocated`)."""
    room = free + max(reserved - allocated, 0)
    if nbytes > room:
        raise InvalidRequestError(
            f"kv_cache_memory_bytes={fmt_bytes(nbytes)} is more than the GPU can hold: {fmt_bytes(room)} of the "
            f"GPU's {fmt_bytes(total)} is free after the weights ({fmt_bytes(allocated)}; other processes hold the "
            f"rest). Lower --kv-cache-memory-bytes, or leave it unset to size the cache from "
            f"--gpu-memory-utilization"
        )


def activation_reserve(max_num_batched_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Bytes kept for the activations of the largest step (hidden states and the logits of up to 1,024 rows)."""
    return 16 * max_num_batched_tokens * hidden_size * 4 + vocab_size * 4 * min(max_num_batched_tokens, 1024)


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in [1, upper] with fits(n) (fits is monotone: true up to a point); 0 when none."""
    lo, hi = 0, upper  # invariant: fits(lo) or lo == 0; nothing above hi fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def smallest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The smallest n in [1, upper] with fits(n) (monotone: false up to a point); upper when none smaller."""
    lo, hi = 1, upper  # invariant: fits(hi) or hi == upper; nothing below lo fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def no_fit_error(
    max_model_len: int,
    bytes_per_token: int,
    bytes_per_state: int,
    one_request: int,
    budget: int,
    largest_len: int,
    gpu: GpuBudget | None,
) -> InvalidRequestError:
    """The start-up error of a model whose cache budget holds no request of max_model_len, with every number."""
    state = f"{fmt_bytes(bytes_per_state)} of recurrent state + " if bytes_per_state else ""
    holds = (
        f"the largest max_model_len it holds is {largest_len} tokens"
        if largest_len > 1
        else "it holds no request at all"
    )
    advice = (
        "raise --gpu-memory-utilization, lower --max-model-len or --max-num-batched-tokens, or spread the "
        "model over more GPUs (--tensor-parallel-size)"
        if gpu is not None
        else "raise --kv-cache-memory-bytes (kv_cache_memory_bytes; 256 MiB by default on the CPU) or lower "
        "--max-model-len"
    )
    return InvalidRequestError(
        f"the model does not fit: one request of max_model_len={max_model_len} tokens needs "
        f"{fmt_bytes(one_request)} of cache ({state}{bytes_per_token} B/token of attention KV), the cache budget is "
        f"{fmt_bytes(max(budget, 0))}{gpu.note() if gpu is not None else ''}: max concurrency at max_model_len="
        f"{max_model_len} is 0 and {holds}. To serve it: {advice}"
    )
