"""What the project's benchmarks (benchmarks/) and the paper's experiments (paper_repro/) stand on:
result files with their command and machine, workloads, streamed-request timing, GPU facts."""
