// The plain scalar reference of every cpu_adam kernel: one element at a time,
// in the order the formulas in cpu_adam/cpu_adam.h are written, using the
// scalar conversions of runtime/dtype.h. The SIMD kernels must agree with it
// bit for bit (tests/cpu_adam). It validates its arguments like the fast path
// and is slow on purpose: never use it on the data path.
//
//   STRATA_RETURN_IF_ERROR(reference::AdamStep(h, state, GradView::F32(g), OutView::None()));
//
// Thread-safe on disjoint spans.
#pragma once

#include "cpu_adam/cpu_adam.h"

namespace strata::reference {

Status AdamStep(const AdamHyper& hyper, const AdamState& state, GradView grad, OutView out);
Status AdagradStep(const AdagradHyper& hyper, const AdagradState& state, GradView grad,
                   OutView out);
Status LionStep(const LionHyper& hyper, const LionState& state, GradView grad, OutView out);
// Sums float(g_i)^2 in double in index order, then multiplies by grad_scale^2.
Result<GradStats> ComputeGradStats(GradView grad, float grad_scale);

}  // namespace strata::reference
