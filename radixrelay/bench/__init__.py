"""Serving benchmark (``benchmarks/serving/bench_serving.py``): workloads, Poisson arrivals, a timing
OpenAI-compatible client, metrics, reports and plots."""
