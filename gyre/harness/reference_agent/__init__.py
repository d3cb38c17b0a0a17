"""Gyre's reference agent: OpenAI Chat Completions client, shell + file tools, automatic
compaction, sub-agent delegation. Runs as a child process:
``python -m gyre.harness.reference_agent --base-url URL/v1 --instruction-file F`` (see
:mod:`~gyre.harness.reference_agent.__main__`). The loop is :mod:`~gyre.harness.reference_agent.agent`,
its pure parts :mod:`~gyre.harness.reference_agent.conversation`, the model client
:mod:`~gyre.harness.reference_agent.client` and the shell and file tools
:mod:`~gyre.harness.reference_agent.tools`."""

from gyre.harness.reference_agent.agent import (
    DEFAULT_SYSTEM_PROMPT,
    SUBAGENT_SYSTEM_PROMPT,
    AgentConfig,
    AgentResult,
    ReferenceAgent,
)
from gyre.harness.reference_agent.client import ChatClient, ContextTooLong, ModelAPIError
from gyre.harness.reference_agent.conversation import (
    COMPACTION_PROMPT,
    CompactionPolicy,
    Conversation,
    ToolCallRequest,
    assistant_message,
    parse_tool_calls,
)
from gyre.harness.reference_agent.tools import ALL_TOOLS, TOOL_SCHEMAS, Toolbox

__all__ = [
    "ALL_TOOLS",
    "AgentConfig",
    "AgentResult",
    "COMPACTION_PROMPT",
    "ChatClient",
    "CompactionPolicy",
    "ContextTooLong",
    "Conversation",
    "DEFAULT_SYSTEM_PROMPT",
    "ModelAPIError",
    "ReferenceAgent",
    "SUBAGENT_SYSTEM_PROMPT",
    "TOOL_SCHEMAS",
    "ToolCallRequest",
    "Toolbox",
    "assistant_message",
    "parse_tool_calls",
]
