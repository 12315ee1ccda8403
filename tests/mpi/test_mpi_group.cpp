// Run under mpirun with 3 processes: the MpiGroup collectives (rank-major all_gather, barrier, one
// identity on every rank).
#include <chrono>
#include <cstdio>
#include <elasticep/elasticep.hpp>
#include <vector>

using namespace elasticep;

#define EXPECT(cond)                                                                     \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            std::fprintf(stderr, "rank check failed at line %d: %s\n", __LINE__, #cond); \
            return 1;                                                                    \
        }                                                                                \
    } while (0)

int main() {
    auto g = MpiGroup::world(std::chrono::milliseconds(500));
    const int r = g->rank(), n = g->size();
    EXPECT(n == 3);
    // all_gather: rank-major, each rank's value
    const auto vals = g->all_gather_value<int64_t>(int64_t{1000} + 7 * r);
    for (int i = 0; i < n; ++i) EXPECT(vals[static_cast<size_t>(i)] == 1000 + 7 * i);
    // identity: the same string on every rank
    std::string id = g->identity();
    id.resize(64, '\0');
    std::vector<char> ids(64 * static_cast<size_t>(n));
    g->all_gather(id.data(), 64, ids.data());
    for (int i = 1; i < n; ++i) EXPECT(std::string(ids.data(), 64) == std::string(ids.data() + 64 * i, 64));
    g->barrier();
    std::printf("rank %d: mpi group ok\n", r);
    return 0;
}
