"""Benchmark harness: load any OpenAI-compatible server over HTTP and measure it.

It talks HTTP only (httpx) and never imports the engine or the model, so it measures a
peer's server exactly as it measures ours.

- `workload`: the requests (synthetic or JSONL) and Poisson arrival times, from a seed;
- `agent`: multi-turn agent conversations, each turn built on the server's real answers;
- `client`: one streaming request, SSE parsing and timing (TTFT, ITL, E2E, usage);
- `runner`: closed loop at fixed concurrency, open loop at a Poisson rate, conversations
  in a closed loop; all bounded;
- `stats`: percentiles, throughput, goodput — the `runs[]` entries of results.json;
- `harness`: the whole benchmark as a library call (`run_benchmark`);
- `report`, `plots`: results.json, report.md and PNG plots;
- `cli`: the `tokenmill bench` options.
"""
