"""``python -m gyre.harness.reference_agent``: Gyre's reference agent as a child process.

The API key comes from ``$GYRE_API_KEY`` (or ``$OPENAI_API_KEY``), never from the command
line. Exit status: 0 final answer given, 3 turn limit reached, 4 the model API failed,
2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from gyre.harness.reference_agent.agent import AgentConfig, AgentResult, ReferenceAgent
from gyre.harness.reference_agent.client import ChatClient, ModelAPIError
from gyre.harness.reference_agent.conversation import CompactionPolicy
from gyre.harness.reference_agent.tools import ALL_TOOLS, Toolbox

EXIT_FINAL, EXIT_USAGE, EXIT_MAX_TURNS, EXIT_API = 0, 2, 3, 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gyre.harness.reference_agent", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="OpenAI-compatible base URL (ending in /v1)")
    p.add_argument("--model", default="gyre-policy")
    task = p.add_mutually_exclusive_group(required=True)
    task.add_argument("--instruction", help="the task text")
    task.add_argument("--instruction-file", help="file holding the task text")
    p.add_argument("--workdir", default=".", help="workspace (default: the current directory)")
    p.add_argument("--tools", default=",".join(ALL_TOOLS), help=f"comma-separated subset of {','.join(ALL_TOOLS)}")
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--max-subagent-turns", type=int, default=10)
    p.add_argument("--compact-threshold-tokens", type=int, default=0, help="compact above this context size (0: off)")
    p.add_argument("--chars-per-token", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--system-prompt", default=None, help="replaces the default system prompt ('' for none)")
    p.add_argument("--bash-timeout-s", type=float, default=60.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--max-retries", type=int, default=6)
    p.add_argument("--final-message-file", default=None)
    p.add_argument("--transcript-file", default=None, help="JSONL events of the run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reference-agent %(levelname)s %(message)s")
    log = logging.getLogger("gyre.reference_agent")
    key = os.environ.get("GYRE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if not key:
        print("error: set GYRE_API_KEY (or OPENAI_API_KEY)", file=sys.stderr)
        return EXIT_USAGE
    try:
        instruction = args.instruction if args.instruction is not None else Path(args.instruction_file).read_text()
        config = AgentConfig(model=args.model, tools=[t for t in args.tools.split(",") if t],
                             max_turns=args.max_turns, max_subagent_turns=args.max_subagent_turns,
                             compaction=CompactionPolicy(args.compact_threshold_tokens, args.chars_per_token),
                             max_tokens=args.max_tokens, temperature=args.temperature,
                             system_prompt=args.system_prompt)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    client = ChatClient(args.base_url, key, timeout_s=args.request_timeout_s, max_retries=args.max_retries)
    toolbox = Toolbox(Path(args.workdir).resolve(), bash_timeout_s=args.bash_timeout_s)
    transcript = open(args.transcript_file, "a") if args.transcript_file else None
    agent = ReferenceAgent(client, toolbox, config, transcript=transcript)
    try:
        result: AgentResult = agent.run(instruction)
    except ModelAPIError as exc:
        log.error("model API failed: %s", exc)
        return EXIT_API
    finally:
        client.close()
        if transcript is not None:
            transcript.close()
    log.info("stop=%s turns=%d model_calls=%d compactions=%d subagents=%d tool_calls=%d", result.stop,
             result.turns, result.model_calls, result.compactions, result.subagents, result.tool_calls)
    if result.final is not None:
        if args.final_message_file:
            Path(args.final_message_file).write_text(result.final)
        print(result.final)
        return EXIT_FINAL
    return EXIT_MAX_TURNS


if __name__ == "__main__":
    sys.exit(main())
