"""The project's own comparisons: serving against its peers, engine speed (`make bench`), the
prefix cache, memory pressure, grammar stalls and the allocator's hot path. The paper's
experiments (allocator bandwidth, step() latency, kernels on either cache) are paper_repro's."""
