#include "backends/cuda/peer_watch.hpp"

#include <cstring>
#include <thread>
#include <vector>

#include "core/check.hpp"
#include "core/protocol.hpp"
#include "kernels/common/cuda_check.hpp"

namespace elasticep::detail::cuda {
namespace {

constexpr size_t kDiagnosedPeers = 64;  // per-peer epochs listed in a diagnosis, then a count

}  // namespace

PeerWatch::PeerWatch(int rank, int num_ranks, std::chrono::milliseconds timeout, const kernels::RegionLayout& region,
                     const transport::SymmetricMemory& window, kernels::HostRecord* record,
                     const kernels::Workspace& ws, cudaStream_t own_stream)
    : rank_(rank),
      num_ranks_(num_ranks),
      timeout_(timeout),
      region_(region),
      window_(window),
      record_(record),
      ws_(ws),
      own_stream_(own_stream),
      scratch_(kFlagsAt + 2 * static_cast<size_t>(num_ranks) * sizeof(kernels::DispatchFlag)) {}

bool PeerWatch::timed_out() const {
    return reinterpret_cast<const volatile int32_t*>(&record_->timeout_phase)[0] != kPhaseNone;
}

void PeerWatch::raise_if_timed_out() {
    if (!timed_out()) return;
    const volatile kernels::HostRecord* r = record_;
    const MissingPeers missing = const_cast<const MissingPeers&>(r->timeout_missing);
    raise(ErrorCode::kTimeout,
          timeout_message(r->timeout_phase, rank_, timeout_.count(), missing, r->timeout_expected) + ". " + diagnose());
}

void PeerWatch::raise_if_peer_fault() const {
    const volatile detail::PeerFault* f = &record_->peer_fault;
    if (f->kind == kPeerOk) return;
    const PeerFault fault{f->kind, f->sender, f->phase, 0, f->value, f->limit};
    raise(ErrorCode::kInternal, peer_fault_message(fault, rank_));
}

template <class Read>
void PeerWatch::poll(int32_t phase, uint64_t expected, int shift, Read&& read) {
    std::vector<uint64_t> seen(static_cast<size_t>(num_ranks_));
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
        read(seen);
        const MissingPeers missing =
            scan_missing([&](int q) { return seen[static_cast<size_t>(q)]; }, num_ranks_, expected);
        if (missing.count == 0) return;
        if (std::chrono::steady_clock::now() - start > timeout_) {
            if (!timed_out()) {
                record_->timeout_missing = missing;
                record_->timeout_missing.observed = missing.observed >> shift;
                record_->timeout_expected = expected >> shift;
                reinterpret_cast<volatile int32_t*>(&record_->timeout_phase)[0] = phase;
            }
            raise_if_timed_out();
        }
        if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
}

void PeerWatch::read_epoch(cudaStream_t call_stream, uint64_t& epoch, int32_t& aborted) {
    ELASTICEP_CUDA_CALL(cudaStreamSynchronize(call_stream));
    scratch_.read_call_state(ws_.epoch, &ws_.state->timed_out, own_stream_, epoch, aborted);
}

void PeerWatch::host_wait(cudaStream_t call_stream, int32_t phase) {
    uint64_t dev_epoch = 0;
    int32_t aborted = 0;
    read_epoch(call_stream, dev_epoch, aborted);
    if (phase == kPhaseCombine && aborted) return;  // the dispatch timed out: nothing was published
    const uint64_t epoch = phase == kPhaseDispatch ? dev_epoch + 1 : dev_epoch;
    const size_t r = static_cast<size_t>(num_ranks_);
    const uint8_t* base = window_.local();
    uint8_t* flags = static_cast<uint8_t*>(scratch_.data()) + kFlagsAt;
    poll(phase, epoch, 0, [&](std::vector<uint64_t>& seen) {
        if (phase == kPhaseDispatch) {
            ELASTICEP_CUDA_CALL(cudaMemcpyAsync(flags, base + region_.dispatch_flags,
                                                2 * r * sizeof(kernels::DispatchFlag), cudaMemcpyDeviceToHost,
                                                own_stream_));
            ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
            for (size_t i = 0; i < r; ++i)
                std::memcpy(&seen[i], flags + (2 * i + (epoch & 1)) * sizeof(kernels::DispatchFlag), sizeof(uint64_t));
        } else {
            ELASTICEP_CUDA_CALL(cudaMemcpyAsync(flags, base + region_.combine_flags, r * sizeof(uint64_t),
                                                cudaMemcpyDeviceToHost, own_stream_));
            ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
            std::memcpy(seen.data(), flags, r * sizeof(uint64_t));
        }
    });
}

void PeerWatch::host_wait_words(cudaStream_t call_stream, int32_t phase, int64_t offset, uint64_t epoch_delta,
                                int shift, uint64_t step) {
    uint64_t dev_epoch = 0;
    int32_t aborted = 0;
    read_epoch(call_stream, dev_epoch, aborted);
    raise_if_timed_out();
    if (aborted) return;  // an earlier wait of this call expired (recorded): nothing more is published
    const uint64_t expected = ((dev_epoch + epoch_delta) << shift) | step;
    const uint8_t* base = window_.local() + offset;
    uint8_t* words = static_cast<uint8_t*>(scratch_.data()) + kFlagsAt;
    poll(phase, expected, shift, [&](std::vector<uint64_t>& seen) {
        ELASTICEP_CUDA_CALL(
            cudaMemcpyAsync(words, base, seen.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost, own_stream_));
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
        std::memcpy(seen.data(), words, seen.size() * sizeof(uint64_t));
    });
}

std::string PeerWatch::diagnose() const {
    const size_t r = static_cast<size_t>(num_ranks_);
    std::vector<uint8_t*> table(r);
    std::vector<kernels::DispatchFlag> disp(2 * r);
    std::vector<uint64_t> comb(r);
    const uint8_t* base = window_.local();
    const std::vector<uint8_t*>& windows = window_.windows();
    if (cudaMemcpy(table.data(), window_.device_windows(), r * sizeof(uint8_t*), cudaMemcpyDeviceToHost) !=
            cudaSuccess ||
        cudaMemcpy(disp.data(), base + region_.dispatch_flags, disp.size() * sizeof(disp[0]), cudaMemcpyDeviceToHost) !=
            cudaSuccess ||
        cudaMemcpy(comb.data(), base + region_.combine_flags, r * sizeof(comb[0]), cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
        cudaGetLastError();
        return "(no diagnosis: the device could not be read)";
    }
    std::string out = "Diagnosis: peer table ";
    bool intact = true;
    for (size_t p = 0; p < r; ++p)
        if (table[p] != windows[p]) {
            out += cat(intact ? "CORRUPT: " : ", ", "entry ", p, " is ", static_cast<void*>(table[p]), " not ",
                       static_cast<void*>(windows[p]));
            intact = false;
        }
    if (intact) out += "intact";
    const size_t listed = r < kDiagnosedPeers ? r : kDiagnosedPeers;
    const std::string more = r > listed ? cat(" (", r - listed, " more)") : "";
    out += "; dispatch epochs here per sender (even/odd slot):";
    for (size_t p = 0; p < listed; ++p) out += cat(" ", p, ":", disp[2 * p].epoch, "/", disp[2 * p + 1].epoch);
    out += more + "; combine epochs here per holder:";
    for (size_t p = 0; p < listed; ++p) out += cat(" ", p, ":", comb[p]);
    out += more;
    if (region_.plan_flags != region_.sent_flags) {  // the direct path's flags
        std::vector<uint64_t> words(4 * r);
        const int64_t offs[4] = {region_.plan_flags, region_.sent_flags, region_.ready_flags, region_.done_flags};
        for (int i = 0; i < 4; ++i)
            if (cudaMemcpy(words.data() + i * r, base + offs[i], r * sizeof(uint64_t), cudaMemcpyDeviceToHost) !=
                cudaSuccess) {
                cudaGetLastError();
                return out + "; (direct flags unreadable)";
            }
        const char* names[4] = {"plan", "sent", "ready", "done"};
        for (int i = 0; i < 4; ++i) {
            out += cat("; direct ", names[i], " epochs per peer:");
            for (size_t p = 0; p < listed; ++p) out += cat(" ", p, ":", words[i * r + p]);
            out += more;
        }
    }
    return out;
}

}  // namespace elasticep::detail::cuda
