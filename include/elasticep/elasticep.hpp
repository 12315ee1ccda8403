// ElasticEP: Mixture-of-Experts dispatch and combine across expert-parallel ranks.
#pragma once

#include "elasticep/buffer.hpp"
#include "elasticep/config.hpp"
#include "elasticep/error.hpp"
#include "elasticep/group.hpp"
#include "elasticep/info.hpp"
#include "elasticep/mpi_group.hpp"
#include "elasticep/serving.hpp"
#include "elasticep/tensor.hpp"
#include "elasticep/traffic.hpp"
#include "elasticep/version.hpp"
