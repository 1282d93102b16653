"""The agentic action formats as the environments read them (docs/action_formats.md): the terminal
takes a ``bash`` tool call as well as a fenced block, and a computer-use reply is one JSON action."""
import json

import pytest

from clawrl.envs.computer_use import Element, parse_action as parse_gui, render_screen
from clawrl.envs.terminal import BASH_TOOL, parse_action


def call(command, name="bash", tagged=True):
    body = json.dumps({"name": name, "arguments": {"command": command}})
    return f"<tool_call>\n{body}\n</tool_call>" if tagged else body


@pytest.mark.parametrize("reply, commands, done", [
    (call("ls -la"), "ls -la", False),
    (call("ls -la", tagged=False), "ls -la", False),  # <tool_call> decoded away as a special token
    ("First:\n" + call("cat a") + "\nthen\n```bash\nwc -l a\n```", "cat a\nwc -l a", False),  # reply order
    ("```bash\nwc -l a\n```\n" + call("cat a"), "wc -l a\ncat a", False),
    (call("echo DONE"), "echo DONE", False),  # DONE inside a call is a command
    (call("make") + "\nDONE", "make", True),
    ('<tool_call>\n{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}\n</tool_call>', "pwd", False),
    (call("ls", name="python"), None, False),  # another tool's call runs nothing
    ("<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \n</tool_call>", None, False),  # bad JSON
    ('<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>', None, False),  # no command
    ('{"name": "bash", "arguments": {"command": "ls"', None, False),  # unfinished bare JSON
])
def test_the_terminal_runs_bash_tool_calls_and_fenced_blocks(reply, commands, done):
    assert parse_action(reply) == (commands, done)


def test_the_bash_tool_is_an_openai_function_with_a_command():
    fn = BASH_TOOL["function"]
    assert fn["name"] == "bash" and fn["parameters"]["required"] == ["command"]


@pytest.mark.parametrize("reply", [
    '{"action": "click", "element": 12}', '{"action": "click", "x": 40, "y": 80}',
    '{"action": "type", "text": "hello"}', '{"action": "key", "key": "Enter"}', ' {"action": "scroll", "dy": -200}\n',
    '{"action": "done"}',
])
def test_a_computer_use_action_is_one_json_object(reply):
    action, error = parse_gui(reply)
    assert error is None and action == json.loads(reply)


@pytest.mark.parametrize("reply, says", [
    ("click 12", "not one JSON object"),
    ('{"action": "click", "element": 12} {"action": "done"}', "not one JSON object"),
    ('{"element": 12}', '"action" field'),
    ('{"action": "drag"}', "unknown action 'drag'"),
    ('{"action": "click", "x": 40}', "'y' as an integer"),
    ('{"action": "click", "element": "12"}', "'element' as an integer"),
    ('{"action": "click", "element": true}', "'element' as an integer"),
    ('{"action": "type", "txt": "hi"}', "not txt"),
    ('{"action": "scroll", "dy": 1.5}', "'dy' as an integer"),
    ('{"action": "done", "why": "finished"}', "no fields, not why"),
])
def test_a_malformed_computer_use_action_says_what_is_wrong(reply, says):
    action, error = parse_gui(reply)
    assert action is None and says in error


def test_the_screen_lists_ids_roles_names_and_boxes():
    screen = [Element(72, "button", "Save", (120, 80, 200, 104)), Element(63, "textbox", 'Say "hi"', (68, 120, 268, 148))]
    assert render_screen(screen, "Click Save.") == (
        'Instruction: Click Save.\n\nScreen (accessibility tree):\n[72] button "Save" (120, 80, 200, 104)\n'
        '[63] textbox "Say \\"hi\\"" (68, 120, 268, 148)')
    assert render_screen(screen).startswith("Screen (accessibility tree):\n[72]")
