"""The ``elasticep`` command (console script of the wheel) and ``python -m elasticep``.

``elasticep bench|info|check [options]`` runs the C++ CLI that the wheel ships next to this file
(elasticep/_bin/elasticep, the same program as a CMake build's tools/elasticep). Where it is absent
(a wheel built without the CLI11 / nlohmann-json headers, or a CMake tree on PYTHONPATH), the Python
fallbacks run: ``bench`` is ``python -m elasticep.bench`` (same options), ``info`` prints what
``elasticep.system_info()`` reports; ``check`` needs the C++ CLI. Without a command: ``info``.
"""

import json
import os
import sys

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "elasticep")


def _cli():
    """The C++ CLI of this install, or None."""
    return _BIN if os.path.isfile(_BIN) and os.access(_BIN, os.X_OK) else None


def _version(v, nccl):
    if v <= 0:
        return "none"
    return "%d.%d.%d" % (v // 10000, v // 100 % 100, v % 100) if nccl else "%d.%d" % (v // 1000, v % 1000 // 10)


def _info(argv):
    import elasticep as ep

    if any(a not in ("--json",) for a in argv):
        sys.stderr.write("error: this install has no C++ CLI: `elasticep info` takes only --json here "
                         "(buffer sizes need the C++ CLI)\n")
        return 2
    si = ep.system_info()
    if not si["gpus"]:
        if "cuda" not in si["backends_compiled"]:
            why = "this build has no CUDA backend (nvcc was not found at build time)"
        elif si["cuda_driver_version"] == 0:
            why = "no NVIDIA driver/GPU found (CUDA said: %s)" % (si["note"] or "no device")
        else:
            why = si["note"] or "no CUDA GPU found"
        si["gpu_unavailable"] = why + ": the CUDA backend is unavailable, the CPU backend is used"
    if "--json" in argv:
        print(json.dumps(si, indent=2))
        return 0
    print("elasticep %s" % si["version"])
    print("backends compiled: %s (auto resolves to %s)" % (si["backends_compiled"], ep._C.resolve_backend("auto")))
    print("CUDA runtime: %s, driver: %s, NCCL: %s" % (_version(si["cuda_runtime_version"], False),
                                                     _version(si["cuda_driver_version"], False),
                                                     _version(si["nccl_version"], True)))
    if si["gpus"]:
        print("GPUs: %d" % len(si["gpus"]))
        for g in si["gpus"]:
            print("  [%d] %s, sm_%d%d, %d SMs, %.2f GiB" % (g["index"], g["name"], g["major"], g["minor"], g["num_sms"],
                                                            g["memory_bytes"] / 2**30))
    else:
        print("GPUs: none: %s" % si["gpu_unavailable"])
    return 0


def main(argv=None):
    """Entry point of the `elasticep` console script; returns the exit code (or does not return)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["info"]
    exe = _cli()
    if exe:
        sys.stdout.flush()
        os.execv(exe, [exe] + argv)
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if cmd == "info":
        return _info(rest)
    if cmd == "--version":
        import elasticep as ep

        print(ep.__version__)
        return 0
    if cmd in ("-h", "--help"):
        print(__doc__)
        return 0
    if cmd == "check":
        sys.stderr.write("error: `elasticep check` needs the C++ CLI, which this install lacks (build it with the "
                         "CLI11 and nlohmann-json headers present: apt-get install libcli11-dev nlohmann-json3-dev)\n")
        return 2
    sys.stderr.write("error: unknown command '%s'; the commands are bench, info and check\n" % cmd)
    return 2


if __name__ == "__main__":
    sys.exit(main())
