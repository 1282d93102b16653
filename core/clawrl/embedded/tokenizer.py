"""The embedded model's tokenizer and chat template.

Byte-level BPE, so any text (unicode, emoji, code) round-trips exactly. Every digit is its own
token: with multi-digit tokens a tiny model memorises sums instead of learning to add (43% vs 95%
of held-out additions in our measurements). The vocabulary is large enough (8192) that agent
prompts take about a third as many tokens as characters, which keeps a 40 KB system prompt
inside the context and cheap to prefill.

The chat format is Qwen2.5/Hermes style (``<|im_start|>role\\n...<|im_end|>``, tools as JSON lines
inside ``<tools></tools>``, calls inside ``<tool_call></tool_call>``, results inside
``<tool_response></tool_response>`` on the user side), so OpenAI-style messages from any client map
onto it and tool calls can be parsed back out of generated text.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_TOKENS = (TOOL_CALL_OPEN, "</tool_call>", "<tools>", "</tools>", "<tool_response>", "</tool_response>")
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END) + TOOL_TOKENS
DEFAULT_VOCAB_SIZE = 8192

# Words, single digits (\p{N} without '+': the point of this tokenizer), punctuation runs and
# whitespace runs, as in GPT-4/Qwen pre-tokenisation.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Jinja, rendered by transformers' sandboxed environment (trim_blocks, lstrip_blocks).
# ``json_args`` re-spaces a JSON string the way ``tojson`` prints the parsed object, so tool-call
# arguments sent as a string (OpenAI's wire format) render exactly like the same arguments as a
# dict; the sandbox has no JSON parser. (Unicode escapes such as \u00e9 stay escaped.)
CHAT_TEMPLATE = r"""{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is string -%}{{ part }}{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro json_args(arguments) -%}
{%- if arguments is string -%}
{%- if arguments | trim == '' -%}{}{%- else -%}
{%- set ns = namespace(in_str=false, esc=false) -%}
{%- for ch in arguments -%}
{%- if ns.in_str -%}{{ ch }}
{%- if ns.esc -%}{%- set ns.esc = false -%}
{%- elif ch == '\\' -%}{%- set ns.esc = true -%}
{%- elif ch == '"' -%}{%- set ns.in_str = false -%}
{%- endif -%}
{%- elif ch == '"' -%}{{ ch }}{%- set ns.in_str = true -%}
{%- elif ch == ',' -%}{{ ', ' }}
{%- elif ch == ':' -%}{{ ': ' }}
{%- elif ch not in ' \t\r\n' -%}{{ ch }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- else -%}{{ arguments | tojson }}
{%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role in ('system', 'developer') -%}
{%- if tools -%}
{{ '<|im_start|>system\n' }}
{%- if has_system -%}{{ text(messages[0].content) + '\n\n' }}{%- endif -%}
{{ '# Tools\n\nYou may call one or more functions. Their signatures, one per line:\n<tools>' }}
{%- for tool in tools -%}
{{ '\n' }}{{ (tool.function if tool.function is defined else tool) | tojson }}
{%- endfor -%}
{{ '\n</tools>\n\nTo call a function, reply with a JSON object inside tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif has_system -%}
{{ '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' }}
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and has_system -%}
{%- elif message.role in ('system', 'developer') -%}
{{ '<|im_start|>system\n' + text(message.content) + '<|im_end|>\n' }}
{%- elif message.role == 'user' -%}
{{ '<|im_start|>user\n' + text(message.content) + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' -%}
{{ '<|im_start|>assistant\n' + text(message.content) }}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first or text(message.content) -%}{{ '\n' }}{%- endif -%}
{{ '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' + json_args(fn.arguments) + '}\n</tool_call>' }}
{%- endfor -%}
{%- endif -%}
{{ '<|im_end|>\n' }}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}
{{ '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\n' }}{%- endif -%}
{%- else -%}
{{ raise_exception('unknown message role: ' + message.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"""


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE on ``texts`` (an ordered iterable: the order decides ties, so the
    same texts give the same tokenizer)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template, eos
    ``<|im_end|>`` and pad ``<|endoftext|>``) so ``AutoTokenizer.from_pretrained`` loads it."""
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=list(TOOL_TOKENS) + [IM_START],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    # In tokenizer_config.json rather than chat_template.jinja, where every serving stack looks.
    hf.save_pretrained(str(out_dir), save_jinja_files=False)


def render_chat(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False) -> str:
    """The chat template applied to ``messages`` (what ``apply_chat_template(tokenize=False)`` gives),
    without needing a saved tokenizer: the corpus renders its training chats with it."""
    rendered, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=CHAT_TEMPLATE, add_generation_prompt=add_generation_prompt
    )
    return rendered[0]
