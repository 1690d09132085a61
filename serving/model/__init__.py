"""The model: loading a checkpoint, a GGUF file or a synthetic model (loader, gguf_weights,
synthetic), what the CPU computes fast (cpu_features), weight formats and linear layers
(weights, linear), the forward pass over an attention callback (runner), and a layer's heads
split over tensor-parallel ranks (tensor_parallel). Nothing here imports the engine: the
runner attends through the `Attend` callback and reads the `AttentionInput` it defines, which
the KV store's iteration batch provides."""
