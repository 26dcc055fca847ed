"""`page-local serve`: an OpenAI-compatible local HTTP server over the engine (docs/serve.md).

    protocol.py  requests validated into a Job, the OpenAI envelopes, stop strings (no framework)
    slots.py     engine slots, the FIFO of waiting requests, the conversation cache (prefix reuse)
    backend.py   loading, one request in a slot's thread, stats
    guards.py    ASGI middleware before any route: Host, Origin (CORS), API keys and namespaces, JSON only
    app.py       the Starlette app: routes, body limits, SSE
    bench.py     `page-local bench serve`: the load test

Floor 5 beside cli/: it uses chat/ and engine/, and engine/narrate.py for the words of a Decision.
Nothing here is imported by `import page_local`; Starlette, uvicorn and sse-starlette (the [serve]
extra) are imported only when a server is built.
"""
