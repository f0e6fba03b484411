"""statecore's benchmarks: one runnable module per hot path (``python -m bench.bench_rowtable``)."""
