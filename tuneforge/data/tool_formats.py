"""tool_format: tools and tool calls written into the conversation's text, for chat templates that do not render
tools themselves (LlamaFactory's tool formats; a template that renders `tools` keeps its own way).

Each format says how the tools are described (appended to the system message) and how the assistant writes a call
(the call syntaxes of tuneforge/infer/tools.py, which `tuneforge api` parses back into `tool_calls`):

| format | tools, in the system message | a call, as the assistant writes it |
|---|---|---|
| default | each tool's name, description and arguments, then how to call | `Action: name` / `Action Input: {...}` |
| qwen | Qwen's `<tools>` block (its chat template's words) | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` |
| llama3 | the JSON-call instruction of Llama 3.1's template, each tool as JSON | `{"name": ..., "parameters": {...}}` |
| mistral | `[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]` | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` |
| qwen3_5 | Qwen3.5's `<tools>` block and calling rules (its template's words) | `<tool_call><function=name><parameter=key>...` |
| ling | Qwen's block, then `detailed thinking off` (Ling's) | as qwen |

A call turn of the data (LlamaFactory's `function_call` message: a JSON call object or a list of them) is
rewritten in the format's syntax; other messages are left as they are.
"""

from __future__ import annotations

import json
from typing import Any

from tuneforge.infer.tools import ToolSyntax, _whole_json

# format -> the call syntax of tuneforge.infer.tools
SYNTAX_OF = {"default": "action", "qwen": "hermes", "llama3": "llama3", "mistral": "mistral", "qwen3_5": "xml",
             "ling": "hermes"}
TOOL_FORMATS = tuple(SYNTAX_OF)
# LlamaFactory's other tool formats, each tied to one model family's own template: that template renders its tools
LATER = ("glm4", "glm4_moe", "gemma4", "lfm2", "minimax1", "minimax2", "seed_oss")


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool) if tool.get("type") == "function" else tool


def _default_tools(tools: list[dict[str, Any]]) -> str:
    lines, names = ["You can use these tools:"], []
    for tool in map(_function, tools):
        names.append(tool["name"])
        lines.append(f"> {tool['name']}: {tool.get('description', '')}")
        params = tool.get("parameters", {})
        required = set(params.get("required", []))
        for name, spec in params.get("properties", {}).items():
            kind = spec.get("type", "any") + (", required" if name in required else "")
            choices = f" (one of {', '.join(map(str, spec['enum']))})" if spec.get("enum") else ""
            lines.append(f"  - {name} ({kind}): {spec.get('description', '')}{choices}")
    lines += [f"To use a tool, answer with two lines:\nAction: the tool's name (one of {', '.join(names)})\n"
              f"Action Input: its arguments as a JSON object"]
    return "\n".join(lines)


def _qwen_tools(tools: list[dict[str, Any]]) -> str:
    listed = "".join("\n" + json.dumps({"type": "function", "function": _function(t)}, ensure_ascii=False)
                     for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>{listed}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _qwen3_5_tools(tools: list[dict[str, Any]]) -> str:
    listed = "".join("\n" + json.dumps(_function(t), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou have access to the following functions:\n\n<tools>" + listed + "\n</tools>\n\nIf you "
            "choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
            "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
            "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple "
            "lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow "
            "the specified format: an inner <function=...></function> block must be nested within "
            "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional "
            "reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there "
            "is no function call available, answer the question like normal with your current knowledge and do not "
            "tell the user about function calls\n</IMPORTANT>")


def _llama3_tools(tools: list[dict[str, Any]]) -> str:
    listed = "\n\n".join(json.dumps({"type": "function", "function": _function(t)}, indent=4, ensure_ascii=False)
                         for t in tools)
    return ("Given the following functions, please respond with a JSON for a function call with its proper arguments "
            'that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": '
            f"dictionary of argument name and its value}}.Do not use variables.\n\n{listed}")


def _mistral_tools(tools: list[dict[str, Any]]) -> str:
    listed = [{"type": "function", "function": _function(t)} for t in tools]
    return f"[AVAILABLE_TOOLS]{json.dumps(listed, ensure_ascii=False)}[/AVAILABLE_TOOLS]"


_TOOLS_TEXT = {"default": _default_tools, "qwen": _qwen_tools, "llama3": _llama3_tools, "mistral": _mistral_tools,
               "qwen3_5": _qwen3_5_tools, "ling": lambda tools: _qwen_tools(tools) + "\ndetailed thinking off"}


def syntax(fmt: str) -> ToolSyntax:
    """The call syntax of a tool format (how `tuneforge api` reads calls back)."""
    return ToolSyntax(SYNTAX_OF[fmt], structured=False)


def apply(fmt: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages with the tools described in the system message and each call turn in the format's syntax.
    Contents may be strings or a processor's lists of parts (a call turn is then its one text part)."""
    out = [dict(m) for m in messages]
    for m in out:
        text = _only_text(m.get("content"))
        if m["role"] == "assistant" and text is not None:
            _, calls = _whole_json(text)
            if calls:
                m["content"] = _with_text(m["content"], syntax(fmt).render(calls))
    if tools:
        described = _TOOLS_TEXT[fmt](tools)
        parts = any(isinstance(m.get("content"), list) for m in out)
        if out and out[0]["role"] == "system":
            system = out[0]["content"]
            if isinstance(system, list):
                out[0]["content"] = [*system, {"type": "text", "text": f"\n\n{described}" if system else described}]
            else:
                out[0]["content"] = f"{system}\n\n{described}" if system else described
        else:
            out.insert(0, {"role": "system", "content": [{"type": "text", "text": described}] if parts else described})
    return out


def _only_text(content: Any) -> str | None:
    """A content's text when it is only text: a string, or a list of one text part."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and len(content) == 1 and content[0].get("type") == "text":
        return content[0].get("text")
    return None


def _with_text(content: Any, text: str) -> Any:
    return text if isinstance(content, str) else [{**content[0], "text": text}]
