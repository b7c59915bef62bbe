// attnres C++ API, the one header to include:
//   - ops.h:     attnres::depth_attention (differentiable; autograd in C++)
//                and the raw ops depth_attention_fwd / depth_attention_bwd,
//   - modules.h: attnres::DepthStream and the torch::nn module
//                attnres::AttnResResidual,
//   - gradient_cache.h: the CPU gradient cache's limit and statistics.
// Link the op library, CMake target attnres::attnres:
//   find_package(attnres CONFIG REQUIRED)
//   target_link_libraries(app PRIVATE attnres::attnres)
// Linking it also registers the torch ops attnres::depth_attention_fwd/bwd
// (their CPU, CUDA and Autograd kernels) when the program loads, which is
// what a TorchScript or AOTInductor model that calls them needs.
#pragma once

#include "attnres/block_reads.h"
#include "attnres/gradient_cache.h"
#include "attnres/modules.h"
#include "attnres/ops.h"
