"""Device kernels the runner launches outside the model's forward (cache maintenance)."""
