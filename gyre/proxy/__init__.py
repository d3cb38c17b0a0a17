"""HTTP front ends (OpenAI / Anthropic / SGLang-native), chat-template rendering, TITO recording, routing."""
