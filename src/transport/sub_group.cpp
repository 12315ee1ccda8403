#include "transport/sub_group.hpp"

#include <algorithm>
#include <cstring>

#include "core/check.hpp"

namespace elasticep::transport {

SubGroup::SubGroup(Group& parent, std::vector<int> members, std::string tag)
    : parent_(parent), members_(std::move(members)), tag_(std::move(tag)) {
    const auto it = std::find(members_.begin(), members_.end(), parent.rank());
    ELASTICEP_INTERNAL(it != members_.end() && std::is_sorted(members_.begin(), members_.end()), "sub-group ", tag_,
                       " must list its members ascending, this rank included");
    rank_ = static_cast<int>(it - members_.begin());
}

void SubGroup::all_gather(const void* send, size_t bytes, void* recv) {
    std::vector<uint8_t> all(bytes * static_cast<size_t>(parent_.size()));
    parent_.all_gather(send, bytes, all.data());
    for (size_t i = 0; i < members_.size(); ++i)
        std::memcpy(static_cast<uint8_t*>(recv) + i * bytes, all.data() + static_cast<size_t>(members_[i]) * bytes,
                    bytes);
}

}  // namespace elasticep::transport
