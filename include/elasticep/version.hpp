#pragma once

namespace elasticep {
inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;
inline constexpr int kVersionPatch = 0;
const char* version_string();
// Backends compiled into this build ("cpu", "cpu,cuda").
const char* build_backends();
}  // namespace elasticep
