// What paired_linear and widened_linear check of their arguments: float32 activations and a
// weight in serving.model.weights.PairedWeight's layout (8-bit, or 4-bit with mins, in groups of
// 32 inputs, stored tile by tile of 16 outputs: 32 x 16 bytes per group and tile, or 16 x 16).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

struct PairedShape {
  int64_t tiles, groups, out, in;
};

// The weight's own checks (widened_bf16 takes no activations); returns its shape.
inline PairedShape check_paired_bytes(const at::Tensor& weight, const at::Tensor& scales,
                                      const std::optional<at::Tensor>& mins, int64_t bits) {
  constexpr int64_t kGroup = 32, kTile = 16;
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == kTile && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be contiguous float32 [tiles, groups, 16]");
  const PairedShape shape{scales.size(0), scales.size(1), scales.size(0) * kTile, scales.size(1) * kGroup};
  const int64_t bytes = shape.tiles * shape.groups * kGroup * kTile * bits / 8;
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == bytes &&
                  (weight.scalar_type() == at::kByte || weight.scalar_type() == at::kChar),
              "weight must be contiguous uint8/int8 with ", bytes, " bytes");
  TORCH_CHECK((bits == 4) == mins.has_value(), "4-bit weights have mins, 8-bit ones none");
  TORCH_CHECK(!mins || (mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->sizes() == scales.sizes()),
              "mins must be contiguous float32 [tiles, groups, 16]");
  return shape;
}

inline PairedShape check_paired_weight(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                                       int64_t bits) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  const PairedShape shape = check_paired_bytes(weight, scales, mins, bits);
  TORCH_CHECK(x.size(-1) == shape.in, "x's last dimension must be the weight's ", shape.in, " inputs, got ",
              x.size(-1));
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == shape.out && bias->is_contiguous()),
              "bias must be float32 [out]");
  return shape;
}
