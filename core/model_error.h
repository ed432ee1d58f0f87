// The error the shipped cost models are held to against published measurements of real clusters
// (validation/published, `trainsim fidelity`, docs/validation.md): the mean and the largest
// |error| per source and overall. One figure for every place that must know how far a prediction
// can be trusted: the fidelity suite's targets (validation/fidelity.h; accepted.yaml states the
// same numbers and tests/test_fidelity.cpp holds them equal) and the smallest gain worth
// recommending a change (sim/sweep/advice.h, kPlanMargin).
#pragma once

namespace trainsim {

inline constexpr double kFidelityTargetMeanError = 0.03;
inline constexpr double kFidelityTargetMaxError = 0.06;

}  // namespace trainsim
