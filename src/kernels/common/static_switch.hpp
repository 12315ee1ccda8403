// Runtime values to template constants, one generic helper for every knob (no macro per knob).
//
//   with_constants([&](auto payload, auto idx64) {
//       my_kernel<decltype(payload)::value, decltype(idx64)::value><<<...>>>(p);
//   }, Choice<Payload, Payload::kA, Payload::kB>{runtime_payload}, Choice<bool, false, true>{runtime_idx64});
//
// calls the lambda once, with std::integral_constant arguments equal to the runtime values; only the
// listed values are compiled, and a value outside the list is an internal error (a bug: the host
// validated it). for_all_constants visits every combination (to load every instantiation up front).
#pragma once

#include <type_traits>
#include <utility>

#include "core/check.hpp"

namespace elasticep::kernels {

template <class T, T... kValues>
struct Choice {
    T value;
};

using BoolChoice = Choice<bool, false, true>;

template <class F>
void with_constants(F&& f) {
    std::forward<F>(f)();
}

template <class F>
void for_all_constants(F&& f) {
    std::forward<F>(f)();
}

namespace switch_detail {

// f(integral_constant<T, kValue>, constants of the remaining choices...)
template <class T, T kValue, class F, class... Rest>
void bind_first(F& f, Rest... rest) {
    with_constants([&](auto... more) { f(std::integral_constant<T, kValue>{}, more...); }, rest...);
}

template <class T, T kValue, class F, class... Rest>
void bind_first_all(F& f, Rest... rest) {
    for_all_constants([&](auto... more) { f(std::integral_constant<T, kValue>{}, more...); }, rest...);
}

}  // namespace switch_detail

template <class F, class T, T... kValues, class... Rest>
void with_constants(F&& f, Choice<T, kValues...> choice, Rest... rest) {
    bool found = false;
    ((!found && choice.value == kValues ? (found = true, switch_detail::bind_first<T, kValues>(f, rest...)) : void()),
     ...);
    ELASTICEP_INTERNAL(found, "with_constants: runtime value ", static_cast<long long>(choice.value),
                       " has no compiled instantiation");
}

template <class F, class T, T... kValues, class... Rest>
void for_all_constants(F&& f, Choice<T, kValues...>, Rest... rest) {
    (switch_detail::bind_first_all<T, kValues>(f, rest...), ...);
}

}  // namespace elasticep::kernels
