"""Claude Code's conversation, as the pinned CLI sends it in the ``claude-code`` loop, for the warm start.

``gyre run --harness claude-code`` runs ``claude -p TASK --bare --system-prompt INSTRUCTIONS --tools
Bash ...`` (services.task.cli_loops). Its Messages requests are then small and regular: a system of
three text blocks (a billing line whose last three hex digits are a fingerprint of the prompt, the
Agent SDK's one-line identity, the instructions), the one ``Bash`` tool below, and the
conversation: the task, each reply's ``tool_use`` and each command's output as a ``tool_result``.
`claude_code_request` builds those bodies; services.task.tool_demos.run_claude_code_demo drives a
model through them the way the CLI does (its reply's tool call runs, its output goes back; a reply
without a call ends the run), each request through the gateway's own Messages -> chat conversion
and endpoint code in process (services.task.local_gateway), so the prompts are those of a real run
up to the fingerprint. ``tests/e2e/test_cli_harnesses.py`` checks these bodies against the
installed CLI's.
"""

from __future__ import annotations

from typing import Any

from services.task.tool_shell import SHELL_INSTRUCTIONS

__all__ = ["CLAUDE_CODE_VERSION", "CLAUDE_CODE_IDENTITY", "CLAUDE_CODE_BASH_TOOL", "MAX_TOKENS", "claude_code_system",
           "claude_code_request", "permission_refusal"]

CLAUDE_CODE_VERSION = "2.1.328"
CLAUDE_CODE_IDENTITY = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
# its Bash tool under --bare (captured from the pinned CLI; the test compares it with the installed one)
CLAUDE_CODE_BASH_TOOL: dict[str, Any] = {'name': 'Bash',
     'description': 'execute shell commands',
     'input_schema': {'$schema': 'https://json-schema.org/draft/2020-12/schema',
                      'type': 'object',
                      'properties': {'command': {'description': 'The command to execute', 'type': 'string'},
                                     'timeout': {'description': 'Optional timeout in milliseconds (max '
                                                                '600000 for a foreground command)',
                                                 'type': 'number'},
                                     'description': {'description': 'Clear, concise description of what '
                                                                    'this command does in active voice. '
                                                                    'Never use words like "complex" or '
                                                                    '"risk" in the description - just '
                                                                    'describe what it does.\n'
                                                                    '\n'
                                                                    'Say what the command does in plain '
                                                                    "words: do not echo the command's text, "
                                                                    'its flags, or file paths - the user '
                                                                    'reads this description, often without '
                                                                    'seeing the command.\n'
                                                                    '\n'
                                                                    'For simple commands (git, npm, '
                                                                    'standard CLI tools), keep it brief '
                                                                    '(5-10 words):\n'
                                                                    '- ls → "List files in current '
                                                                    'directory"\n'
                                                                    '- git status → "Show working tree '
                                                                    'status"\n'
                                                                    '- npm install → "Install package '
                                                                    'dependencies"\n'
                                                                    '\n'
                                                                    'For commands that are harder to parse '
                                                                    'at a glance (piped commands, obscure '
                                                                    'flags, etc.), add enough context to '
                                                                    'clarify what it does:\n'
                                                                    '- find . -name "*.tmp" -exec rm {} \\; '
                                                                    '→ "Find and delete all .tmp files '
                                                                    'recursively"\n'
                                                                    '- git reset --hard origin/main → '
                                                                    '"Discard all local changes and match '
                                                                    'remote main"\n'
                                                                    "- curl -s url | jq '.data[]' → "
                                                                    '"Fetch JSON from URL and extract data '
                                                                    'array elements"',
                                                     'type': 'string'},
                                     'dangerouslyDisableSandbox': {'description': 'Set this to true to '
                                                                                  'dangerously override '
                                                                                  'sandbox mode and run '
                                                                                  'commands without '
                                                                                  'sandboxing.',
                                                                   'type': 'boolean'}},
                      'required': ['command'],
                      'additionalProperties': False}}
MAX_TOKENS = 256  # CLAUDE_CODE_MAX_OUTPUT_TOKENS in the loop


def claude_code_system(fingerprint: str, instructions: str = SHELL_INSTRUCTIONS) -> list[dict[str, Any]]:
    """The system blocks; ``fingerprint`` is the billing line's three hex digits (per prompt)."""
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version={CLAUDE_CODE_VERSION}.{fingerprint}; "
                                     "cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": CLAUDE_CODE_IDENTITY, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": instructions, "cache_control": {"type": "ephemeral"}}]


def claude_code_request(messages: list[dict[str, Any]], *, fingerprint: str, model: str,
                        instructions: str = SHELL_INSTRUCTIONS) -> dict[str, Any]:
    """A Messages body as the CLI sends it (the fields the gateway reads; the CLI's metadata,
    thinking, context-management and effort fields are ignored there)."""
    return {"model": model, "messages": messages, "system": claude_code_system(fingerprint, instructions),
            "tools": [CLAUDE_CODE_BASH_TOOL], "max_tokens": MAX_TOKENS, "stream": False}


def permission_refusal(tool: str) -> str:
    """The CLI's tool_result for a call its permission settings do not allow."""
    return f"Claude requested permissions to use {tool}, but you haven't granted it yet."
