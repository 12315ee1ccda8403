// The seam between bench and where a backend keeps its tensors and how its calls are timed.
//
// The CPU backend works on host memory and returns when the work is done, so inputs are used in
// place, outputs are read in place and a steady clock times a call. A device backend needs its
// own implementation of both interfaces: `BenchMemory` copies the inputs to the device once and
// the outputs back for verification (outside the timed region), `PhaseTimer` records events on
// the call's stream and reads them after a synchronize. make_bench_memory / make_phase_timer
// pick the implementation for a resolved backend (the CUDA one is backend_io_cuda.cpp, built
// with the CUDA backend); nothing else in bench knows the backend.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "elasticep/config.hpp"
#include "elasticep/tensor.hpp"

namespace elasticep::cli {

class PhaseTimer {
 public:
    virtual ~PhaseTimer() = default;
    // Marks the start of the timed call on `stream` (nullptr on CPU).
    virtual void start(void* stream) = 0;
    // Marks its end and returns the elapsed microseconds once the work has finished.
    virtual double stop_us(void* stream) = 0;
};

class BenchMemory {
 public:
    virtual ~BenchMemory() = default;
    // A tensor on the backend's device holding `bytes` of `host` (kept alive by this object).
    virtual TensorRef upload(const void* host, DType dtype, std::vector<int64_t> shape) = 0;
    // A device tensor of the given shape for an input rewritten every round (combine's y);
    // refresh() copies host bytes into it.
    virtual TensorRef scratch(DType dtype, std::vector<int64_t> shape) = 0;
    virtual void refresh(const TensorRef& device, const void* host) = 0;
    // A host-readable copy (or the tensor itself when it is host memory) of the first `bytes` of
    // the storage a result tensor spans; the pointer is valid until the next fetch of this slot.
    virtual const void* fetch(const TensorRef& t, size_t bytes, int slot) = 0;
    virtual void* stream() = 0;
};

std::unique_ptr<PhaseTimer> make_phase_timer(BackendKind resolved);
std::unique_ptr<BenchMemory> make_bench_memory(BackendKind resolved, int rank);

}  // namespace elasticep::cli
