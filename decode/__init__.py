"""The decode (consumer) worker: pulls a prefilled prompt's KV blocks and recurrent state from a prefill worker,
continues exactly where a colocated engine would, and streams tokens. Without transfer params it computes the
whole prompt itself (colocated mode)."""
