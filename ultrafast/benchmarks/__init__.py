"""Benchmarks, each a CLI verb: `bench` (decode vs the memory roofline and llama.cpp), `specbench`
(Spec-Bench, both tiers side by side), `agentbench` (an agent loop re-sending the same file)."""
