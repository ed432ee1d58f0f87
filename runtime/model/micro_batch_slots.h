// A stage model's micro-batches in flight, written once for every device: each one's stash (what
// its forward keeps) and backward (its gradients' buffers) from its forward to the end of its
// backward, how many of the stage's backward units it has done, the buffers later micro-batches
// reuse, and the errors of a call out of order. The CPU StageModel and the CUDA stage model keep
// them alike (runtime/model/stage_layout.h's Stash and Backward of their own buffers).
//
// A micro-batch's life: begin_forward (a stash), begin_backward (a backward, whole or split);
// whole: next_unit per backward unit, then finish_whole; split: its input pass at once, then
// weight_pass or next_weight_unit per unit; release gives both buffers back.
#pragma once

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runtime/model/stage_layout.h"

namespace trainsim::runtime {

template <class Buf, class Ids>
class MicroBatchSlots {
 public:
  using StashT = Stash<Buf, Ids>;
  using BackwardT = Backward<Buf>;
  struct Slot {
    std::unique_ptr<StashT> stash;
    std::unique_ptr<BackwardT> backward;
    int units_done = 0;     // backward units (whole) or weight units (split) done
    bool complete = false;  // its backward has ended: every gradient is final
  };

  // `who` names the model in errors ("StageModel", "CudaStageModel").
  explicit MicroBatchSlots(std::string who) : who_(std::move(who)) {}

  Slot& at(int mb) {
    if (mb < 0) throw std::invalid_argument("micro-batch index " + std::to_string(mb) + " is negative");
    if (static_cast<std::size_t>(mb) >= slots_.size()) slots_.resize(static_cast<std::size_t>(mb) + 1);
    return slots_[static_cast<std::size_t>(mb)];
  }
  // The micro-batch's slot, or nullptr where none was ever used.
  const Slot* find(int mb) const {
    return mb < 0 || static_cast<std::size_t>(mb) >= slots_.size() ? nullptr : &slots_[static_cast<std::size_t>(mb)];
  }
  const std::vector<Slot>& all() const { return slots_; }

  // The forward of `mb`: a stash released by an earlier micro-batch, or make_stash()'s.
  template <class MakeStash>
  Slot& begin_forward(int mb, MakeStash&& make_stash) {
    Slot& sl = at(mb);
    if (sl.stash)
      throw std::logic_error(who_ + "::forward: micro-batch " + std::to_string(mb) +
                             " already has a forward waiting for its backward");
    sl.stash = reuse_or_make(free_stashes, make_stash);
    sl.units_done = 0;
    sl.complete = false;
    return sl;
  }

  // The backward of `mb` (split: the zero-bubble input pass now, the weight pass later): a
  // backward of the kind released earlier, or make_backward(split)'s.
  template <class MakeBackward>
  Slot& begin_backward(int mb, bool split, MakeBackward&& make_backward) {
    Slot& sl = at(mb);
    if (!sl.stash) throw std::logic_error(who_ + ": backward of micro-batch " + std::to_string(mb) + " without its forward");
    if (sl.backward) throw std::logic_error(who_ + ": backward of micro-batch " + std::to_string(mb) + " has already begun");
    sl.backward = reuse_or_make(free_backwards, split, [&] { return make_backward(split); });
    sl.units_done = 0;
    return sl;
  }

  // A whole backward's next unit of `units`.
  Slot& next_unit(int mb, std::size_t units) {
    Slot& sl = at(mb);
    if (!sl.backward || sl.backward->split)
      throw std::logic_error(who_ + "::backward_unit: micro-batch " + std::to_string(mb) + " has no backward_begin");
    if (done(sl) >= units)
      throw std::logic_error(who_ + "::backward_unit: micro-batch " + std::to_string(mb) + " has done all " +
                             std::to_string(units) + " units");
    return sl;
  }
  // A whole backward that has done all its `units`, at its end.
  Slot& finish_whole(int mb, std::size_t units) {
    Slot& sl = at(mb);
    if (!sl.backward || sl.backward->split || done(sl) != units)
      throw std::logic_error(who_ + "::backward_end: micro-batch " + std::to_string(mb) + " has done " +
                             std::to_string(sl.units_done) + " of " + std::to_string(units) + " backward units");
    return sl;
  }
  // A split backward whose input pass is done, at its (whole) weight pass.
  Slot& weight_pass(int mb) {
    Slot& sl = at(mb);
    if (!sl.backward || !sl.backward->split || !sl.backward->inputs_done)
      throw std::logic_error(who_ + "::backward_weight: micro-batch " + std::to_string(mb) + " has no backward_input");
    return sl;
  }
  // A split backward's next weight unit of `units`.
  Slot& next_weight_unit(int mb, std::size_t units) {
    Slot& sl = at(mb);
    if (!sl.backward || !sl.backward->split || !sl.backward->inputs_done || done(sl) >= units)
      throw std::logic_error(who_ + "::backward_weight_unit: micro-batch " + std::to_string(mb) +
                             " has no backward_input or no weight unit left");
    return sl;
  }

  // How many leading gradients of the stage's `total` are final for `mb`: all once its backward
  // ended, else grads_end(i) of the last unit i it has done, 0 before any.
  template <class GradsEnd>
  std::size_t gradients_complete(int mb, std::size_t total, GradsEnd&& grads_end) const {
    const Slot* sl = find(mb);
    if (!sl) return 0;
    if (sl->complete) return total;
    return sl->units_done > 0 ? grads_end(sl->units_done - 1) : 0;
  }

  // The micro-batch's backward has ended: its buffers go to later micro-batches.
  void release(Slot& sl) {
    free_stashes.push_back(std::move(sl.stash));
    free_backwards.push_back(std::move(sl.backward));
    sl.complete = true;
  }

  // Released buffers (reserve() fills them ahead, so that a step allocates nothing).
  std::vector<std::unique_ptr<StashT>> free_stashes;
  std::vector<std::unique_ptr<BackwardT>> free_backwards;

 private:
  static std::size_t done(const Slot& sl) { return static_cast<std::size_t>(sl.units_done); }

  std::string who_;
  std::vector<Slot> slots_;  // by micro-batch
};

}  // namespace trainsim::runtime
