"""Chat messages to a prompt: the checkpoint's chat template, a config's, or BLOOM's default.

Which template: `server.chat_template` (a Jinja file) if the config names one, else the
`chat_template` of the checkpoint's tokenizer_config.json, else `DEFAULT_TEMPLATE`, written for
BLOOM and BLOOMZ (which ship none): each turn on its own line as `User: ...` / `Assistant: ...`
(any other role by its name: `Tool: ...`), a system message first as plain text, and the
prompt ending in `Assistant:` for the model to continue. Templates render in Jinja's sandbox,
as transformers renders them, with `messages`, `add_generation_prompt`, `bos_token`,
`eos_token` and `raise_exception`; a template is checked at start-up by rendering a sample
conversation, so a broken one stops the server before it serves. Every render has a budget
(`BoundedSandbox`): RENDER_SECONDS of time, checked at each call, attribute, item and piece of
output, MAX_OUTPUT characters of prompt, and no string or list multiplied past that size; a
template over it is that request's 400, and the server goes on (a loop whose body touches
nothing is seen by the clock when the next range is made: Jinja caps a range at 100,000).
What is not here: the HTTP route (oai.py).
"""

from __future__ import annotations

import json
import operator
import threading
import time
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 1.0  # a template renders in well under a millisecond
MAX_OUTPUT = 4_000_000  # characters: a prompt far longer than any max_seq_len holds
_budget = threading.local()  # this thread's render deadline (renders run on worker threads)

DEFAULT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}{{ message.content + '\\n\\n' }}"
    "{%- elif message.role == 'user' -%}{{ 'User: ' + message.content + '\\n' }}"
    "{%- elif message.role == 'assistant' -%}{{ 'Assistant: ' + message.content + '\\n' }}"
    "{%- else -%}{{ message.role | capitalize + ': ' + message.content + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}"
)
SAMPLE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


class TemplateOverBudget(ValueError):
    """A render ran past RENDER_SECONDS or MAX_OUTPUT."""


def _tick() -> None:
    deadline = getattr(_budget, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateOverBudget(f"the chat template ran past its {RENDER_SECONDS:g} s budget")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with the render's clock checked wherever a template does
    anything, and `*` / `**` bounded (`'a' * 10**10` would allocate before any check)."""

    intercepted_binops = frozenset({"*", "**"})

    def call(self, __context, __obj, *args, **kwargs):
        _tick()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator_: str, left, right):
        _tick()
        if operator_ == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > MAX_OUTPUT:
                        raise TemplateOverBudget("the chat template builds a sequence past its "
                                                 f"budget of {MAX_OUTPUT} items")  # fmt: skip
            return operator.mul(left, right)
        if isinstance(right, int) and abs(right) > 1024:
            raise TemplateOverBudget("the chat template raises to a power above its budget, 1024")
        return operator.pow(left, right)


class ChatTemplate:
    def __init__(self, source: str, *, origin: str, bos_token: str = "", eos_token: str = ""):
        self.origin, self.bos, self.eos = origin, bos_token, eos_token
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols"])  # fmt: skip
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(source)
            self.render(SAMPLE)
        except (jinja2.TemplateError, ValueError) as e:
            raise ValueError(f"chat template from {origin} does not render: {e}") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> str:  # fmt: skip
        """The prompt; `continue_final_message` (vLLM's): the last message left open, so the
        model continues it (no end of turn after it, no generation prompt)."""
        text = self._render(messages=messages, bos_token=self.bos, eos_token=self.eos,
                            add_generation_prompt=add_generation_prompt
                            and not continue_final_message)  # fmt: skip
        if continue_final_message:
            last = messages[-1]["content"]
            at = text.rfind(last) if last else -1
            text = text[: at + len(last)] if at >= 0 else text.rstrip()
        return text

    def _render(self, **context) -> str:
        """The template's output within the budget, gathered piece by piece."""
        _budget.deadline = time.monotonic() + RENDER_SECONDS
        try:
            pieces, size = [], 0
            for piece in self.template.generate(**context):
                size += len(piece)
                if size > MAX_OUTPUT:
                    raise TemplateOverBudget("the chat template ran past its output budget of "
                                             f"{MAX_OUTPUT} characters")  # fmt: skip
                _tick()
                pieces.append(piece)
            return "".join(pieces)
        finally:
            _budget.deadline = None


def _raise(message: str):
    raise ValueError(message)


def load_chat_template(model_dir: str, configured: str = "") -> ChatTemplate:
    """The template for a model directory: `configured` (a file path), the tokenizer's, or
    the default; a ValueError naming the file when it is missing or does not render."""
    tok_config = {}
    path = Path(model_dir) / "tokenizer_config.json"
    if path.is_file():
        try:
            tok_config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} cannot be read: {e}") from None
    tokens = {k: _token_text(tok_config.get(k)) for k in ("bos_token", "eos_token")}
    if configured:
        file = Path(configured)
        if not file.is_file():
            raise ValueError(f"server.chat_template={configured!r}: no such file")
        return ChatTemplate(file.read_text(), origin=str(file), **tokens)
    source = tok_config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if isinstance(source, str) and source.strip():
        return ChatTemplate(source, origin=str(path), **tokens)
    return ChatTemplate(DEFAULT_TEMPLATE, origin="mpinfer's default for BLOOM", **tokens)


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "</s>", ...} as tokenizers write added tokens
        value = value.get("content")
    return value if isinstance(value, str) else ""
