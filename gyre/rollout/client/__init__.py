"""Clients of a rollout engine over SGLang's native HTTP API, and the messages they exchange.

``engine_client.py`` (blocking, httpx) and ``async_client.py`` (asyncio, aiohttp) send the calls
``messages.py`` builds and parse the answers with it; ``base.py`` is what the two clients share;
``token_json.py`` writes a long ``input_ids`` list as JSON; ``sglang_protocol.py`` tells an SGLang
server from the embedded engine and asks a server whether it has weight-update sessions.  Both
backends answer them: the embedded engine (:mod:`gyre.rollout.embedded`) and a real SGLang server
(:mod:`gyre.rollout.sglang_driver`).
"""
