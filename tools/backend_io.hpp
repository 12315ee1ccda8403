// The seam between bench and where a backend keeps its tensors, how its calls are timed and how
// they are captured into a CUDA graph.
//
// The CPU backend works on host memory and returns when the work is done, so inputs are used in
// place, outputs are read in place and a steady clock stamps the marks. The CUDA implementation
// (backend_io_cuda.cpp, built with the CUDA backend) gives each rank thread a GPU and a
// non-blocking stream, copies inputs to the device once and outputs back only for verification
// (outside the timed calls), records CUDA events as marks and captures / replays CUDA graphs.
// make_rank_device picks the implementation for a resolved backend; nothing else in bench knows
// the backend.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "elasticep/config.hpp"
#include "elasticep/tensor.hpp"

namespace elasticep::cli {

// A captured dispatch + combine, replayed on the stream it was captured on.
class Replay {
 public:
    virtual ~Replay() = default;
    virtual void launch() = 0;
};

class RankDevice {
 public:
    virtual ~RankDevice() = default;
    // The CUDA device of this rank, or -1 on the host.
    virtual int device() const = 0;
    // The stream a rank's calls go on (cudaStream_t; nullptr on the host).
    virtual void* stream() = 0;
    // A tensor on the device holding a copy of `host` (kept alive by this object).
    virtual TensorRef upload(const void* host, DType dtype, std::vector<int64_t> shape) = 0;
    // A zero-filled device tensor (kept alive by this object); refresh() copies host bytes in.
    virtual TensorRef scratch(DType dtype, std::vector<int64_t> shape) = 0;
    virtual void refresh(const TensorRef& device, const void* host) = 0;
    // A host-readable copy (or the tensor itself when it is host memory) of the first `bytes` of
    // the storage a result tensor spans; valid until the next fetch of the same slot.
    virtual const void* fetch(const TensorRef& t, size_t bytes, int slot) = 0;
    // Waits until everything queued on stream() has finished.
    virtual void synchronize() = 0;
    // Records mark `i` on the stream (a steady-clock stamp on the host). elapsed_us(from, to):
    // microseconds between two marks, valid after synchronize().
    virtual void mark(int i) = 0;
    virtual double elapsed_us(int from, int to) = 0;
    // Makes marks [0, n) ready to record, so that no timed call pays for creating one.
    virtual void reserve_marks(int n) = 0;
    // Microseconds from `ref`'s mark `ref_mark` to this rank's mark `my_mark` (negative when this
    // one came first), valid after both synchronize(); NaN when the two are not on one clock (ranks
    // on different GPUs).
    virtual double since_us(RankDevice& ref, int ref_mark, int my_mark) = 0;
    // Captures the calls `body` enqueues on stream() into a CUDA graph (Unsupported on the host).
    virtual std::unique_ptr<Replay> capture(const std::function<void()>& body) = 0;
};

// rank r of a run over `num_gpus` GPUs uses GPU r % num_gpus.
std::unique_ptr<RankDevice> make_rank_device(BackendKind resolved, int rank, int num_gpus);

// GPUs this process sees (0 without CUDA or without a usable driver).
int visible_gpus();
// "NVIDIA H200" for the info line of the report; "" without CUDA.
std::string gpu_name(int device);
// Device-to-device copy bandwidth of `device` in GB/s, counting read + write (the HBM floor's
// denominator): median of timed 512 MiB copies. Throws Unsupported without CUDA.
double measure_copy_gbps(int device);

// Why no GPU is usable, in the user's terms (the CUDA error name included), or "" when one is.
std::string gpu_unavailable_reason();

}  // namespace elasticep::cli
