"""``lca-serve``: an OpenAI-compatible HTTP server over the decode runtime with continuous
batching (``decode.batch``: the slot batch it drives; ``scheduler``: requests in and out of
slots; ``schema``: request checking; ``metrics``: Prometheus; ``app``: the FastAPI app;
``process``: the server as a child process, for tests and tools/bench_serve.py)."""
