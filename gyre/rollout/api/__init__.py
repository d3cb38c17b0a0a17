"""SGLang's native HTTP API as data, with no I/O: what the clients send and the embedded engine
parses, checks and answers.

``sglang_api.py`` holds sampling parameters (which the clients send), ``/generate`` bodies and
their checks, finish reasons, ``meta_info`` and log-prob triples, stop-string trimming and
incremental detokenisation; ``sglang_control_api.py`` the control bodies (abort, pause, memory,
weight updates and weight-update groups); ``request_validators.py`` the checks both use, which
raise :class:`~gyre.rollout.api.request_validators.ProtocolError` (HTTP 400).
"""
