// A Group of some ranks of a parent Group (a node, a rail of the hybrid topology), whose collectives run
// through the parent: every rank of the parent calls the same collective of its own sub-group at the
// same time (each rank builds its sub-groups in the same order), so one parent all_gather serves all of
// them. Ranks keep their parent order.
#pragma once

#include <string>
#include <vector>

#include "elasticep/group.hpp"

namespace elasticep::transport {

class SubGroup final : public Group {
 public:
    // `members`: parent ranks, ascending, including parent.rank().
    SubGroup(Group& parent, std::vector<int> members, std::string tag);
    int rank() const override { return rank_; }
    int size() const override { return static_cast<int>(members_.size()); }
    void all_gather(const void* send, size_t bytes, void* recv) override;
    void barrier() override { parent_.barrier(); }
    std::string identity() const override { return parent_.identity() + "/" + tag_; }
    const std::vector<int>& members() const { return members_; }

 private:
    Group& parent_;
    std::vector<int> members_;
    std::string tag_;
    int rank_ = -1;
};

}  // namespace elasticep::transport
