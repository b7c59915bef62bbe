// The CPU kernels (kernels_cpu.cpp, the only file built with the vector ISA
// flags) as called by the host sequence (attnres/op_sequence.h).
#pragma once

#include "attnres/op_sequence.h"

namespace attnres {
namespace cpu {

void forward(const ForwardCall& call);
void backward(const BackwardCall& call);

}  // namespace cpu
}  // namespace attnres
