"""The serving side of a deployment, inside each ingress replica.

- `app`: the Ray Serve deployment (Ingress); `http`: its FastAPI app (vLLM's OpenAI routers + ours);
  `direct`: the replica's own HTTP server; `guard`: in-flight cap, draining, body checks.
- `frontend`: vLLM's serving configuration without an engine; `engine_client`: our vLLM EngineClient;
  `admit`: streams are admitted before they start; `context`: the request's SLO headers.
- `job`: one generate() call (n completions); `leg`: one completion across prefill -> KV -> decode.
- `metrics`, `transfers`: Prometheus metrics and per-request KV transfer records.
"""
