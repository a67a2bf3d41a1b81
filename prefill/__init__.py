"""The prefill (producer) worker: computes prompts to N-1 tokens and holds their caches under a lease until the
decode worker has pulled them."""
