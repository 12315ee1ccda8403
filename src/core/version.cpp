#include "elasticep/version.hpp"

namespace elasticep {

const char* version_string() { return ELASTICEP_VERSION_STRING; }

}  // namespace elasticep
