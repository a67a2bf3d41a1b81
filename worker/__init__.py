"""Plumbing both worker roles share: process bootstrap (engine + transfer agent + gRPC + metrics server),
Health/Stats answers, and proto <-> engine conversions. The role logic lives in `prefill/` and `decode/`."""
