"""Adapters between ElasticEP and the engines and kernels that consume its layouts.

Each submodule imports its third-party side lazily and on its own, so importing this package needs
nothing beyond elasticep:

- :mod:`elasticep.integrations.sglang`: :class:`~elasticep.integrations.sglang.ElasticEPDispatcher`,
  a token dispatcher subclassing SGLang's own ``BaseDispatcher`` (needs torch and SGLang's
  ``token_dispatcher/base.py``; importing the module raises ImportError naming what is missing).
- :mod:`elasticep.integrations.deepgemm`: :class:`~elasticep.integrations.deepgemm.DeepGemmExperts`,
  the FP8 expert FFN on DeepGEMM's grouped GEMMs, fed by the dispatch outputs with no copy (needs
  torch on a CUDA GPU and ``deep_gemm``).

docs/INTEGRATIONS.md is the guide.
"""
