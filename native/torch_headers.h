// The torch headers the operators include, precompiled once by the Makefile (GCC's .gch in
// build/ops/, used through -include): parsing them took 19 s of each source's compile on the
// 2-core VM, more than half of the native build in `make setup`. A .gch GCC cannot use (other
// flags, another torch) is skipped and the headers parsed as usual. Not <ATen/ATen.h>: it
// declares every operator, half again the parse (39 s against 27 on that VM) and 1.5x the .gch
// each source loads; a source includes the <ATen/ops/...> it calls.
#ifndef VATTN_TORCH_HEADERS_H
#define VATTN_TORCH_HEADERS_H
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/dot.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>
#endif
