// CPU kernels of the two-phase Block read ops (docs/design.md §10), built
// with the vector ISA flags like kernels_cpu.cpp; reached only through
// csrc/block_reads.cpp, which checks the arguments, allocates the outputs
// and checks the CPU's capability first. Never called with T == 0. The
// calls are device-neutral (attnres/block_read_sequence.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "attnres/block_read_sequence.h"  // the device-neutral calls
#include "attnres/op_sequence.h"  // OutNormBackward

namespace attnres {
namespace cpu {

void block_reads_forward(const BlockReadsForwardCall& call);
void block_reads_backward(const BlockReadsBackwardCall& call);
void block_read_merge_forward(const MergeForwardCall& call);
void block_read_merge_backward(const MergeBackwardCall& call);

}  // namespace cpu
}  // namespace attnres
