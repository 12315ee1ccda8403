// GoogleTest assertions over the shared test layer (tests/common): rank errors, error codes and
// texts, and a rank's round outcome against the oracle. Used by the unit and gpu suites.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>
#include <vector>

#include "common/rank_round.hpp"
#include "common/ranks.hpp"

namespace eptest {

// Fails the test for every rank that raised.
inline bool all_ok(const std::vector<std::exception_ptr>& errors, const std::string& context = "") {
    bool ok = true;
    for (size_t r = 0; r < errors.size(); ++r)
        if (errors[r]) {
            ADD_FAILURE() << context << " rank " << r << " raised: " << describe(errors[r]);
            ok = false;
        }
    return ok;
}

// The exception is an elasticep::Error with `code` whose message holds every needle.
inline testing::AssertionResult is_error(const std::exception_ptr& e, ErrorCode code,
                                         const std::vector<std::string>& needles = {}) {
    if (!e) return testing::AssertionFailure() << "expected " << error_code_name(code) << ", nothing was raised";
    try {
        std::rethrow_exception(e);
    } catch (const Error& err) {
        if (err.code() != code)
            return testing::AssertionFailure() << "expected " << error_code_name(code) << ", got " << err.what();
        for (const std::string& n : needles)
            if (err.message().find(n) == std::string::npos)
                return testing::AssertionFailure() << "message lacks '" << n << "': " << err.what();
        return testing::AssertionSuccess() << err.what();
    } catch (const std::exception& x) {
        return testing::AssertionFailure() << "expected elasticep::Error, got " << x.what();
    }
    return testing::AssertionFailure() << "unreachable";
}

template <class Fn>
testing::AssertionResult throws_error(Fn&& fn, ErrorCode code, const std::vector<std::string>& needles = {}) {
    try {
        fn();
    } catch (...) {
        return is_error(std::current_exception(), code, needles);
    }
    return testing::AssertionFailure() << "expected " << error_code_name(code) << ", nothing was raised";
}

// One failure per difference (dispatch_mismatches).
inline void expect_dispatch_equal(const ref::RankDispatch& want, const Observed& got, const BufferConfig& cfg,
                                  bool zero_padding, const std::string& ctx) {
    bool fatal = false;
    for (const std::string& m : dispatch_mismatches(want, got, cfg, zero_padding, &fatal))
        ADD_FAILURE() << ctx << " " << m;
    if (fatal) FAIL() << ctx << ": shapes differ, nothing else compared";
}

// The expected MN-major / row-major scale strides of one rank's result.
inline void expect_scale_layout(const Scenario& sc, const RankOutcome& o, const std::string& ctx) {
    const bool fp8 = sc.cfg.payload == Payload::kFP8;
    EXPECT_EQ(o.scales_present, fp8) << ctx;
    if (!fp8 || !o.scales_present) return;
    const int64_t cols = scale_columns(sc.cfg.scale_format, sc.cfg.hidden);
    const int64_t e_local = sc.cfg.num_experts / sc.num_ranks;
    const int64_t rc = int64_t{sc.num_ranks} * sc.cfg.max_tokens_per_rank;
    std::vector<int64_t> want;
    if (sc.opt.layout == Layout::kExpertContiguous) {
        const int64_t rows = o.scale_shape[0];
        // caller-provided storage keeps the stride of its worst-case shape
        const int64_t storage_rows = sc.caller_outputs ? worst_case_rows(sc) : rows;
        want = sc.mn_major ? std::vector<int64_t>{1, round_up4(storage_rows)} : std::vector<int64_t>{cols, 1};
        EXPECT_EQ(o.scale_shape, (std::vector<int64_t>{rows, cols})) << ctx;
    } else {
        want = sc.mn_major ? std::vector<int64_t>{cols * round_up4(rc), 1, round_up4(rc)}
                           : std::vector<int64_t>{rc * cols, cols, 1};
        EXPECT_EQ(o.scale_shape, (std::vector<int64_t>{e_local, rc, cols})) << ctx;
    }
    EXPECT_EQ(o.scale_strides, want) << ctx << (sc.mn_major ? " (MN-major)" : " (row-major)");
}

// Every check of one rank's outcome against the oracle: dispatch outputs, scale layout, handle,
// caller memory, inputs, combine output.
inline void expect_outcome(const Scenario& sc, const RankOutcome& o, const ref::RankDispatch& want,
                           const std::vector<uint16_t>& want_out, const std::string& ctx) {
    for (const std::string& m : outcome_mismatches(sc, o, want, want_out)) ADD_FAILURE() << ctx << " " << m;
    expect_scale_layout(sc, o, ctx);
}

}  // namespace eptest
