"""The OpenAI-compatible HTTP gateway in front of an ``Engine``: ``create_app(cfg, engine, linker)``.

Endpoints: ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /healthz`` (no
key), and for the admin ``GET /admin/status``, ``GET /admin/sessions``,
``GET /admin/sessions/{id}``, ``PATCH /admin/turns/{id}`` ``{"label": "main"|"side"|"excluded"}``:
``server.admin_key`` opens them, the API key never does, and without an admin key they answer
loopback clients under a loopback host name only (``auth.AdminGuard``). Session ids may hold ``/``.

What clawrl adds to, or does differently from, OpenAI's API (documented here because clients see it):

- ``server.api_key`` may be several keys separated by commas; each key is a separate caller, and
  two callers' sessions never merge (nor do two values of the body ``user`` field).
- Request headers ``X-Session-Id`` (or body ``session_id``), ``X-Turn-Type: main|side`` and
  ``X-Session-Done: 1`` steer session linking (``clawrl.sessions``). Responses carry
  ``X-Session-Id``; non-streaming responses also ``X-Turn-Ids`` (one stored turn per choice).
- ``tool_choice`` is honoured by prompting (see ``render``): ``none`` hides the tools,
  ``required`` and a named function prefill the start of a ``<tool_call>``.
- ``max_tokens`` is clamped to the context left after the prompt (then ``finish_reason: length``).
- ``top_k`` is accepted; ``presence_penalty``/``frequency_penalty`` only at 0; ``store`` is
  accepted and changes nothing; every other unknown or unimplemented parameter is a 400 naming it.
- Bodies nested deeper than 100 levels, and text holding a lone UTF-16 surrogate (``"\\ud800"``,
  valid JSON but not unicode) are 400s naming where (``json_limits``). As in OpenAI, a ``tool``
  message must answer a ``tool_calls`` id of the assistant message before it, and
  ``function.arguments`` must be a string.
- Bodies must be ``Content-Type: application/json`` (415 else). A Host header outside
  ``server.allowed_hosts`` is 421, an ``Origin`` that is neither the server's own nor in
  ``server.allowed_origins`` is 403, and CORS is answered for those origins only (``origin``).
- ``system_fingerprint`` is ``clawrl-w<weight version>``: which weights answered.
- Overload (``server.max_queue`` requests already waiting for one of ``engine.max_batch_size``
  slots) is 429 with ``Retry-After``; engine failures are 503 with OpenAI's error JSON.
"""
