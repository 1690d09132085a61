"""The OpenAI-compatible HTTP server over the engine.

`settings` says what to serve, `app` builds the FastAPI app, `routes` maps requests to
the engine, `protocol` holds the request bodies, `responses` shapes bodies and SSE
chunks, `errors` and `body_limit` answer bad input with 4xx, `connections` sets how uvicorn
serves (a deadline for request headers), `async_engine` runs the engine on its own thread,
`metrics` exports Prometheus figures and `cli` is `vattn serve`.
"""
