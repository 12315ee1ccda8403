#include "transport/device_pool.hpp"

#include <algorithm>
#include <map>
#include <mutex>

#include "kernels/common/cuda_check.hpp"

namespace elasticep::transport {

cudaMemPool_t device_pool(int device) {
    static std::mutex mu;
    static std::map<int, cudaMemPool_t> pools;
    std::lock_guard<std::mutex> lock(mu);
    auto it = pools.find(device);
    if (it != pools.end()) return it->second;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    ELASTICEP_CUDA_CALL(cudaMemPoolCreate(&pool, &props));
    int n = 0;
    ELASTICEP_CUDA_CALL(cudaGetDeviceCount(&n));
    for (int d = 0; d < n; ++d) {
        int can = 0;
        if (d == device || cudaDeviceCanAccessPeer(&can, d, device) != cudaSuccess || !can) continue;
        cudaMemAccessDesc desc{};
        desc.location.type = cudaMemLocationTypeDevice;
        desc.location.id = d;
        desc.flags = cudaMemAccessFlagsProtReadWrite;
        ELASTICEP_CUDA_CALL(cudaMemPoolSetAccess(pool, &desc, 1));
    }
    pools.emplace(device, pool);
    return pool;
}

void* pool_alloc(size_t bytes, int device, cudaStream_t stream) {
    void* p = nullptr;
    ELASTICEP_CUDA_CALL(cudaMallocFromPoolAsync(&p, std::max<size_t>(bytes, 256), device_pool(device), stream));
    return p;
}

void GrowingBlock::reserve(size_t n, int device, cudaStream_t stream, std::vector<void*>& graveyard) {
    n = std::max<size_t>(n, 256);
    if (n <= bytes) return;
    void* p = pool_alloc(n, device, stream);
    if (ptr) graveyard.push_back(ptr);
    ptr = p;
    bytes = n;
}

}  // namespace elasticep::transport
