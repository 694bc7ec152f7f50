"""Shared code of the benchmark tools (``tools/*.py``), which are thin command lines over it.

* ``args``: argument helpers (one-line usage errors, comma lists, counts, model shape flags).
* ``report``: the JSON object a tool prints, progress lines on stderr.
* ``timing``: timing loops (median of jitted calls, one timed call).
* ``machine``: what ran a benchmark (CPU model, cores, jax backend and devices, host memory).
* ``models``: models of a config file or shape flags, random weights, prompts of real text.
* ``decode``: the cached decode engine's throughput, step bound, HLO and profile.
* ``train``: a config's train step: its compiled costs, timed steps and profile.
* ``model_step``: forward + backward time of a model on random bytes.
* ``kernel``: LCA attention implementations timed side by side.
* ``serve``: clients of a running lca-serve and their latencies.
* ``upstream``: the paper's PyTorch code, loaded from a checkout (``--upstream-src``).
* ``upstream_side``: the paper's training step, in this process or in a child process.
* ``upstream_train`` / ``upstream_decode``: both sides' training steps and decoding.
* ``kernel_estimate``: the same LCA attention programs compiled for a GPU target, estimated.
* ``gpu_check_summary``: ``tools/gpu_check.sh``'s closing lines, measured beside estimated.
"""
