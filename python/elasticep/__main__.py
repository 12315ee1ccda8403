"""``python -m elasticep``: prints what this build and machine offer (``python -m elasticep.bench``
runs the benchmark)."""

import json

from . import system_info

print(json.dumps(system_info(), indent=2))
