// What every stage model must do with a micro-batch's calls out of their order: the CPU
// StageModel's test (tests/runtime/test_model.cpp) and the CUDA stage model's
// (tests/cuda/test_stage_model_cuda.cpp). Both keep their micro-batches in flight with
// runtime/model/micro_batch_slots.h.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>

namespace trainsim::runtime::testing {

// `m` and `clean`: two models of one full stage (embedding and head, more than one backward unit),
// the same weights, zeroed gradients. Every call out of order on `m` throws and changes nothing:
// micro-batch 0 (a whole backward) and 1 (a split one) then run in order on both, and `m`'s
// gradients (gradients(model), on the host) are `clean`'s bit for bit.
template <class Model, class Gradients>
void expect_calls_out_of_order_throw(Model& m, Model& clean, const std::int32_t* tokens, const std::int32_t* targets,
                                     Gradients&& gradients) {
  const auto forward = [&](Model& s, int mb) { s.forward(mb, tokens, targets, nullptr, nullptr); };
  const int units = m.backward_units();
  ASSERT_GT(units, 1);

  EXPECT_THROW(m.backward_begin(0, nullptr, 1.0f), std::logic_error) << "no forward yet";
  EXPECT_THROW(m.backward_unit(0), std::logic_error) << "no backward begun";
  EXPECT_THROW(forward(m, -1), std::invalid_argument);
  // A whole backward: one begin, every unit, then its end.
  forward(m, 0);
  EXPECT_THROW(forward(m, 0), std::logic_error) << "its stash waits for its backward";
  m.backward_begin(0, nullptr, 1.0f);
  EXPECT_THROW(m.backward_begin(0, nullptr, 1.0f), std::logic_error) << "begun twice";
  EXPECT_THROW(m.backward_input(0, nullptr, 1.0f, nullptr), std::logic_error) << "begun as whole";
  EXPECT_THROW(m.backward_end(0, nullptr), std::logic_error) << "no unit done";
  EXPECT_THROW(m.backward_weight(0), std::logic_error) << "not a split backward";
  EXPECT_THROW(m.backward_weight_unit(0), std::logic_error) << "not a split backward";
  for (int u = 0; u < units; ++u) m.backward_unit(0);
  EXPECT_THROW(m.backward_unit(0), std::logic_error) << "every unit done";
  m.backward_end(0, nullptr);
  EXPECT_THROW(m.backward_end(0, nullptr), std::logic_error) << "ended twice";
  // A split backward: its input half, then its weight units one by one, then the end of its weight pass.
  forward(m, 1);
  EXPECT_THROW(m.backward_weight(1), std::logic_error) << "no input half yet";
  m.backward_input(1, nullptr, 1.0f, nullptr);
  EXPECT_THROW(m.backward_unit(1), std::logic_error) << "a split backward has no whole units";
  EXPECT_THROW(m.backward_end(1, nullptr), std::logic_error) << "a split backward ends with its weight pass";
  for (int u = 0; u < units; ++u) m.backward_weight_unit(1);
  EXPECT_THROW(m.backward_weight_unit(1), std::logic_error) << "no weight unit left";
  const std::size_t total = gradients(m).size();
  EXPECT_EQ(m.gradients_complete(1), total);
  EXPECT_GT(m.activation_bytes(), 0u) << "held until the weight pass ends";
  m.backward_weight(1);  // no unit left: it only ends the pass
  EXPECT_EQ(m.activation_bytes(), 0u) << "both micro-batches' buffers released";
  EXPECT_THROW(m.backward_weight(1), std::logic_error) << "ended twice";

  // The same micro-batches in order on a model that saw no mistake: the same gradients, bit for bit.
  forward(clean, 0);
  clean.backward_begin(0, nullptr, 1.0f);
  for (int u = 0; u < units; ++u) clean.backward_unit(0);
  clean.backward_end(0, nullptr);
  forward(clean, 1);
  clean.backward_input(1, nullptr, 1.0f, nullptr);
  clean.backward_weight(1);
  const auto got = gradients(m), want = gradients(clean);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "gradient " << i;
}

}  // namespace trainsim::runtime::testing
