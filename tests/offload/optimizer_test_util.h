// Test helpers for the engine: a model of device tensors with random params
// and grads, and the all-in-memory reference optimizer (plain per-tensor
// arrays updated by cpu_adam's scalar reference) the engine is compared with.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/cpu_adam_reference.h"
#include "kernels/kernels.h"
#include "offload/layout.h"
#include "offload/loss_scaler.h"
#include "offload/optimizer.h"
#include "runtime/device.h"
#include "runtime/dtype.h"

namespace strata::testing {

inline uint16_t ToHalf(float f, DType t) { return t == DType::kBF16 ? F32ToBF16(f) : F32ToF16(f); }
inline float FromHalf(uint16_t h, DType t) {
  return t == DType::kBF16 ? BF16ToF32(h) : F16ToF32(h);
}

// Writes `values` (fp32) into `dst` as `dtype`; returns what float(dst[i]) reads back.
inline std::vector<float> StoreAs(std::span<const float> values, void* dst, DType dtype) {
  std::vector<float> back(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      static_cast<float*>(dst)[i] = values[i];
      back[i] = values[i];
    } else {
      const uint16_t h = ToHalf(values[i], dtype);
      static_cast<uint16_t*>(dst)[i] = h;
      back[i] = FromHalf(h, dtype);
    }
  }
  return back;
}

// The trainer's tensors of one rank, in device memory of `device`
// (host-addressable: the host device).
class TestModel {
 public:
  TestModel(Device& device, std::vector<uint64_t> sizes, std::vector<uint32_t> group_of,
            DType param_dtype, DType grad_dtype)
      : device_(device),
        sizes_(std::move(sizes)),
        group_of_(std::move(group_of)),
        param_dtype_(param_dtype),
        grad_dtype_(grad_dtype) {
    for (uint64_t n : sizes_) {
      data_.push_back(
          std::move(*device.Allocate(std::max<uint64_t>(n, 1) * DTypeSize(param_dtype))));
      grad_.push_back(
          std::move(*device.Allocate(std::max<uint64_t>(n, 1) * DTypeSize(grad_dtype))));
    }
  }
  size_t size() const { return sizes_.size(); }
  uint64_t elems(size_t t) const { return sizes_[t]; }
  uint32_t group_of(size_t t) const { return group_of_[t]; }

  // Sets the params; returns their fp32 values (what the master starts as).
  std::vector<std::vector<float>> SetParams(std::mt19937_64& rng) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<std::vector<float>> out;
    for (size_t t = 0; t < size(); ++t) {
      std::vector<float> v(sizes_[t]);
      for (float& x : v) x = d(rng);
      out.push_back(StoreAs(v, data_[t].data(), param_dtype_));
    }
    return out;
  }
  // Writes tensor t's param (a trainer's own write); returns its fp32 values.
  std::vector<float> SetParam(size_t t, const std::vector<float>& v) {
    return StoreAs(v, data_[t].data(), param_dtype_);
  }
  // Writes grads; returns float(grad) per tensor.
  std::vector<std::vector<float>> SetGrads(const std::vector<std::vector<float>>& g) {
    std::vector<std::vector<float>> out;
    for (size_t t = 0; t < size(); ++t) out.push_back(StoreAs(g[t], grad_[t].data(), grad_dtype_));
    return out;
  }
  std::vector<std::vector<float>> RandomGrads(std::mt19937_64& rng, float stddev) const {
    std::normal_distribution<float> d(0.0f, stddev);
    std::vector<std::vector<float>> g;
    for (size_t t = 0; t < size(); ++t) {
      std::vector<float> v(sizes_[t]);
      for (float& x : v) x = d(rng);
      g.push_back(std::move(v));
    }
    return g;
  }
  // The raw bytes of a param tensor.
  std::vector<uint8_t> ParamBytes(size_t t) const {
    const auto* p = static_cast<const uint8_t*>(data_[t].data());
    return {p, p + sizes_[t] * DTypeSize(param_dtype_)};
  }
  std::vector<uint8_t> GradBytes(size_t t) const {
    const auto* p = static_cast<const uint8_t*>(grad_[t].data());
    return {p, p + sizes_[t] * DTypeSize(grad_dtype_)};
  }

  // Moves tensor t's param and grad to new device memory (same contents) and
  // frees the old, as a trainer that replaces a param's storage does.
  std::pair<void*, void*> Relocate(size_t t) {
    for (auto* v : {&data_, &grad_}) {
      DeviceBuffer moved = std::move(*device_.Allocate((*v)[t].bytes()));
      std::memcpy(moved.data(), (*v)[t].data(), (*v)[t].bytes());
      (*v)[t] = std::move(moved);
    }
    return {data_[t].data(), grad_[t].data()};
  }

  std::vector<ParamGroup> Groups(std::span<const GroupHyper> hypers) const {
    std::vector<ParamGroup> groups(hypers.size());
    for (size_t g = 0; g < hypers.size(); ++g) groups[g].hyper = hypers[g];
    for (size_t t = 0; t < size(); ++t) {
      groups[group_of_[t]].params.push_back({.name = "t" + std::to_string(t),
                                             .data = data_[t].data(),
                                             .grad = grad_[t].data(),
                                             .elems = sizes_[t]});
    }
    return groups;
  }
  // Tensors in the engine's flat order (groups in order, tensors in order inside).
  std::vector<size_t> FlatOrder() const {
    std::vector<size_t> order;
    for (uint32_t g = 0; g <= *std::max_element(group_of_.begin(), group_of_.end()); ++g) {
      for (size_t t = 0; t < size(); ++t) {
        if (group_of_[t] == g) order.push_back(t);
      }
    }
    return order;
  }

 private:
  Device& device_;
  std::vector<uint64_t> sizes_;
  std::vector<uint32_t> group_of_;
  DType param_dtype_, grad_dtype_;
  std::vector<DeviceBuffer> data_, grad_;
};

// Plain arrays per tensor, updated with cpu_adam's scalar reference, with the
// engine's global decisions (loss scaler, clipping) made the same way.
class ReferenceOptimizer {
 public:
  ReferenceOptimizer(const OffloadConfig& config, std::vector<std::vector<float>> master,
                     std::vector<uint32_t> group_of, std::vector<GroupHyper> hypers)
      : config_(config),
        master_(std::move(master)),
        group_of_(std::move(group_of)),
        hypers_(std::move(hypers)),
        scaler_(*LossScaler::Create(config.loss_scaler)) {
    for (auto& t : master_) {
      m_.emplace_back(t.size(), 0.0f);
      v_.emplace_back(t.size(), 0.0f);
      out_.emplace_back(t.size() * DTypeSize(config.param_dtype), 0);
    }
  }

  // One step on `grads` (fp32, the reduced gradient each tensor sees) whose
  // squared norm the engine computes as `flat_sum_sq` (over its padded flat
  // buffer; the order of that sum is the engine's). Returns whether it skipped.
  bool Step(const std::vector<std::vector<float>>& grads, double sum_sq, uint64_t nonfinite) {
    LossScaleDecision d = *scaler_.Update(nonfinite);
    if (d.skip_step) return true;
    ++step_;
    const float mult = GradMultiplier(d.scale_used, sum_sq, config_.max_grad_norm);
    for (size_t t = 0; t < master_.size(); ++t) {
      const GroupHyper& h = hypers_[group_of_[t]];
      const size_t n = master_[t].size();
      OutView out{config_.param_dtype, out_[t].data(), n};
      GradView g = GradView::F32(grads[t]);
      Status s;
      switch (config_.optimizer) {
        case OptimizerType::kAdam:
        case OptimizerType::kAdamW:
          s = reference::AdamStep({.lr = h.lr,
                                   .beta1 = h.beta1,
                                   .beta2 = h.beta2,
                                   .eps = h.eps,
                                   .weight_decay = h.weight_decay,
                                   .weight_decay_mode = config_.optimizer == OptimizerType::kAdam
                                                            ? WeightDecayMode::kL2
                                                            : WeightDecayMode::kDecoupled,
                                   .bias_correction = config_.adam.bias_correction,
                                   .step = step_,
                                   .grad_scale = mult},
                                  {master_[t], m_[t], v_[t]}, g, out);
          break;
        case OptimizerType::kAdagrad:
          s = reference::AdagradStep({.lr = h.lr,
                                      .lr_decay = config_.adagrad.lr_decay,
                                      .eps = h.eps,
                                      .weight_decay = h.weight_decay,
                                      .step = step_,
                                      .grad_scale = mult},
                                     {master_[t], m_[t]}, g, out);
          break;
        case OptimizerType::kLion:
          s = reference::LionStep({.lr = h.lr,
                                   .beta1 = h.beta1,
                                   .beta2 = h.beta2,
                                   .weight_decay = h.weight_decay,
                                   .grad_scale = mult},
                                  {master_[t], m_[t]}, g, out);
          break;
      }
      EXPECT_TRUE(s.ok()) << s;
    }
    return false;
  }

  const std::vector<uint8_t>& out(size_t t) const { return out_[t]; }
  const std::vector<float>& master(size_t t) const { return master_[t]; }
  const std::vector<float>& m(size_t t) const { return m_[t]; }
  const std::vector<float>& v(size_t t) const { return v_[t]; }
  int64_t step() const { return step_; }
  double scale() const { return scaler_.scale(); }

 private:
  OffloadConfig config_;
  std::vector<std::vector<float>> master_, m_, v_;
  std::vector<std::vector<uint8_t>> out_;
  std::vector<uint32_t> group_of_;
  std::vector<GroupHyper> hypers_;
  LossScaler scaler_;
  int64_t step_ = 0;
};

// The squared norm and non-finite count the engine computes over one rank's
// sub-groups, as GradPath defines them: for each sub-group in order, for
// each tensor piece in it in order, kernels::GradStats's order over the
// piece, the piece sums added in that order. `grads` are the values the
// engine reads (float of the trainer's dtype; the reduced average with
// several ranks).
inline GradStats ShardStats(const FlatLayout& layout, std::span<const ElemRange> sub_groups,
                            const std::vector<size_t>& flat_order,
                            const std::vector<std::vector<float>>& grads) {
  GradStats total;
  for (const ElemRange& sg : sub_groups) {
    const std::vector<TensorPiece> pieces = *PiecesInRange(layout, sg);
    for (const TensorPiece& p : pieces) {
      if (p.elems == 0) continue;
      const float* g = grads[flat_order[p.tensor]].data() + p.tensor_offset_elems;
      const kernels::DeviceGradStats s =
          *kernels::GradStatsOnHost({g, p.elems, DType::kF32}, 1.0f);
      total.sum_sq += s.sum_sq;
      total.nonfinite_elems += s.nonfinite_elems;
    }
  }
  return total;
}
inline GradStats FlatStats(const OffloadOptimizer& opt, const std::vector<size_t>& flat_order,
                           const std::vector<std::vector<float>>& grads) {
  return ShardStats(opt.layout(), opt.sub_groups(), flat_order, grads);
}

// Compares the engine's state (ReadState: host-side, on every backend) with
// the reference, bit for bit; `flat_order` maps flat tensor indices to the
// reference's. Padding state must be zero.
inline void ExpectStateSameAsReference(OffloadOptimizer& opt, const std::vector<size_t>& flat_order,
                                       const ReferenceOptimizer& ref) {
  const uint32_t arrays = opt.StateArrayCount();
  for (uint32_t i = 0; i < opt.sub_groups().size(); ++i) {
    const ElemRange sg = opt.sub_groups()[i];
    std::vector<float> state(sg.elems() * arrays);
    Status s = opt.ReadState(i, state);
    ASSERT_TRUE(s.ok()) << s;
    std::vector<uint8_t> covered(sg.elems(), 0);
    const std::vector<TensorPiece> pieces = *PiecesInRange(opt.layout(), sg);
    for (const TensorPiece& p : pieces) {
      const size_t t = flat_order[p.tensor];
      for (uint64_t k = 0; k < p.elems; ++k) {
        const uint64_t at = p.flat_offset_elems - sg.begin + k;
        const uint64_t in = p.tensor_offset_elems + k;
        covered[at] = 1;
        ASSERT_EQ(std::bit_cast<uint32_t>(state[at]), std::bit_cast<uint32_t>(ref.master(t)[in]))
            << "master of tensor " << t << " elem " << in << " (sub-group " << i << ")";
        ASSERT_EQ(std::bit_cast<uint32_t>(state[sg.elems() + at]),
                  std::bit_cast<uint32_t>(ref.m(t)[in]))
            << "moment 1 of tensor " << t << " elem " << in;
        if (arrays == 3) {
          ASSERT_EQ(std::bit_cast<uint32_t>(state[2 * sg.elems() + at]),
                    std::bit_cast<uint32_t>(ref.v(t)[in]))
              << "moment 2 of tensor " << t << " elem " << in;
        }
      }
    }
    for (uint64_t at = 0; at < sg.elems(); ++at) {
      if (covered[at]) continue;
      for (uint32_t a = 0; a < arrays; ++a) {
        ASSERT_EQ(state[a * sg.elems() + at], 0.0f)
            << "padding elem " << at << " of sub-group " << i;
      }
    }
  }
}

// Compares the engine's params (device tensors, read in place: the host
// device only) and state with the reference, bit for bit.
inline void ExpectSameAsReference(OffloadOptimizer& opt, const TestModel& model,
                                  const ReferenceOptimizer& ref) {
  ASSERT_TRUE(opt.device().Synchronize().ok());
  for (size_t t = 0; t < model.size(); ++t) {
    ASSERT_EQ(model.ParamBytes(t), ref.out(t)) << "params of tensor " << t;
  }
  ExpectStateSameAsReference(opt, model.FlatOrder(), ref);
}

// The reference takes the step the optimizer just took on `grads` (its
// statistics as the engine defines them); the two must then agree bitwise.
inline void ExpectStepLikeReference(OffloadOptimizer& opt, const TestModel& model,
                                    ReferenceOptimizer& ref,
                                    const std::vector<std::vector<float>>& grads) {
  const GradStats st = FlatStats(opt, model.FlatOrder(), grads);
  ref.Step(grads, st.sum_sq, st.nonfinite_elems);
  ExpectSameAsReference(opt, model, ref);
}

}  // namespace strata::testing
