"""`page-local serve`: an OpenAI-compatible local HTTP server over the engine (docs/serve.md).

    errors.py    ApiError (the OpenAI error envelope) and `bad` (a 400): no serve imports
    fields.py    which request fields are read; sampling, structured output, logprobs fields -> a Job
    protocol.py  requests validated into a Job, the OpenAI envelopes, stop strings (no framework)
    slots.py     engine slots, the FIFO of waiting requests, the conversation cache (prefix reuse)
    backend.py   loading, one request in a slot's thread, stats
    guards.py    ASGI middleware before any route: Host, Origin (CORS), API keys and namespaces, JSON only
    http.py      what the routes share: body limits, client-gone, collecting an answer, a turn from slot to
                 response (run_turn), readiness
    chat_template.py  the model's Jinja chat template with tools; a conversation tokenized with its text as text
    tools.py     tool calling: tools and tool_choice validated, the call grammar, calls read back from the text
    openai.py    OpenAI's routes (models, chat and text completions, SSE)
    responses.py OpenAI's Responses API, stateless (/v1/responses)
    ollama.py    Ollama's routes;  model_routes.py: embeddings, tokenize, detokenize
    app.py       the Starlette app assembled from the routes, the guards and the error handlers
    bench.py     `page-local bench serve`: the load test

Floor 5 beside cli/: it uses chat/ and engine/, and engine/narrate.py for the words of a Decision.
Nothing here is imported by `import page_local`; Starlette, uvicorn and sse-starlette (the [serve]
extra) are imported only when a server is built.
"""
