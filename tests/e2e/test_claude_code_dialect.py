"""What the warm start shows the tool model of Claude Code (services.task.claude_code_dialect) is
what the pinned CLI sends in the claude-code loop: the real CLI, run with the loop's own argv,
environment and sandbox (services.task.cli_loops), against a scripted Messages server that
answers one gyre-task call and then a reply; each body it sent, as the gateway reads it
(``to_chat``), equals the one `claude_code_request` builds for the same conversation."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from services.rollout.anthropic_http import to_chat
from services.task.claude_code_dialect import claude_code_request
from services.task.cli_loops import claude_code_argv, claude_code_env, sandbox_argv
from services.task.netbridge import UnixToTcp
from services.task.tool_shell import SHELL_INSTRUCTIONS, TaskSocket, install_client
from tests.support import clis

pytestmark = pytest.mark.slow
TASK = "task modules m1 . next gyre-task open_module m1"
RESULT = "module m1 tests 1 -> 9 . next gyre-task write_line m1 step x"


def _events(message: dict[str, Any]) -> bytes:
    """A Messages response as the stream the CLI reads."""
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 1}}})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "tool_use":
            events += [("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": {**block, "input": {}}}),
                       ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                           "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})]
        else:
            events += [("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": {"type": "text", "text": ""}}),
                       ("content_block_delta", {"type": "content_block_delta", "index": i,
                                                "delta": {"type": "text_delta", "text": block["text"]}})]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                                     "stop_sequence": None},
                                  "usage": {"output_tokens": 5}}),
               ("message_stop", {"type": "message_stop"})]
    return b"".join(f"event: {e}\ndata: {json.dumps(d)}\n\n".encode() for e, d in events)


REPLIES = [
    {"id": "msg_1", "type": "message", "role": "assistant", "model": "gyre", "stop_reason": "tool_use",
     "content": [{"type": "tool_use", "id": "call_0001", "name": "Bash",
                  "input": {"command": "gyre-task open_module m1"}}]},
    {"id": "msg_2", "type": "message", "role": "assistant", "model": "gyre", "stop_reason": "end_turn",
     "content": [{"type": "text", "text": "done"}]},
]


@pytest.fixture
def scripted() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 -- the stdlib's name
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            if "/messages/count_tokens" in self.path:
                data, kind = b'{"input_tokens": 1}', "application/json"
            else:
                bodies.append(body)
                data, kind = _events(REPLIES[min(len(bodies), len(REPLIES)) - 1]), "text/event-stream"
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1]), bodies
    server.shutdown()


def test_the_warm_start_bodies_are_the_pinned_claude_code_s(tmp_path: Path,
                                                           scripted: tuple[int, list[dict[str, Any]]]) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make install)")
    try:
        exe = clis.npm_cli(*clis.CLAUDE_CODE)
    except clis.CliUnavailable as exc:
        pytest.skip(str(exc))
    port, bodies = scripted
    root = tmp_path / "root"
    work, home, bin_dir = root / "work", root / "home", root / "bin"
    for d in (work, home):
        d.mkdir(parents=True)
    install_client(bin_dir)
    task = TaskSocket(bin_dir / "task.sock", lambda argv: RESULT)
    bridge = UnixToTcp(root / "gateway.sock", "127.0.0.1", port)
    try:
        argv = sandbox_argv(root, bin_dir, work, home, [exe.parents[2]],
                            claude_code_env("http://127.0.0.1:8080/s/TOKEN", "gyre"),
                            claude_code_argv(exe, TASK, SHELL_INSTRUCTIONS, max_turns=5))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    finally:
        bridge.close()
        task.close()
    assert proc.returncode == 0 and len(bodies) == 2, (proc.stdout[-2000:], proc.stderr[-2000:], len(bodies))
    conversation = [
        [{"role": "user", "content": TASK}],
        [{"role": "user", "content": TASK}, {"role": "assistant", "content": REPLIES[0]["content"]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_0001", "content": RESULT}]}],
    ]
    for sent, messages in zip(bodies, conversation, strict=True):
        fingerprint = sent["system"][0]["text"].split("cc_version=", 1)[1].split(";", 1)[0].rsplit(".", 1)[1]
        assert len(fingerprint) == 3
        ours = claude_code_request(messages, fingerprint=fingerprint, model="gyre")
        assert to_chat({**sent, "stream": False}) == to_chat(ours)
