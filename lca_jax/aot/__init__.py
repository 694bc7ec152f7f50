"""Compiling the production programs for GPUs on a host without one (deviceless AOT).

``targets`` names the GPUs and gives abstract devices of them, ``programs`` builds the train,
eval and decode programs from abstract arguments on those devices, ``report`` reads what each
compiled program needs (memory against the device's, compile time, kernels, custom calls,
kernels per decode step). ``lca-train --aot h100:8`` and ``tools/gpu_aot.py`` are built on it.
"""
