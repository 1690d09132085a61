// The torch headers every operator includes, precompiled once by the Makefile (GCC's .gch in
// build/ops/, used through -include): parsing them took 19 s of each source's compile on the
// 2-core VM, more than half of the native build in `make setup`. A .gch GCC cannot use (other
// flags, another torch) is skipped and the headers parsed as usual.
#ifndef VATTN_TORCH_HEADERS_H
#define VATTN_TORCH_HEADERS_H
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#endif
