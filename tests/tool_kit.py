"""Chat templates that write tools and tool calls the way three model families' templates do
(written for these tests, in each family's format: Hermes/Qwen ``<tool_call>``, Llama 3.x JSON
with the ``ipython`` role, Mistral ``[TOOL_CALLS]``), and a tokenizer of a tiny model carrying
one. The tests (tests/service/test_tools.py, test_serve_tools.py) render conversations through them with
transformers' own ``apply_chat_template``. It holds no tests itself."""

from __future__ import annotations

HERMES = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures, within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, answer with a JSON object within <tool_call></tool_call> tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": ' "
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- if not loop.last %}{{- '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3 = (
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\nTo call a function, answer "
    "only with {\"name\": function name, \"parameters\": its arguments as an object}.\\n\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- elif message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message.tool_calls %}"
    "{{- '{\"name\": \"' + call.function.name + '\", \"parameters\": ' + (call.function.arguments | tojson) + '}' }}"
    "{%- if not loop.last %}{{- '; ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|eom_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{%- endif %}"
    "{{- '[TOOL_RESULTS] ' + ({'content': message.content, 'call_id': message.tool_call_id} | tojson) "
    "+ '[/TOOL_RESULTS]' }}"
    "{%- elif message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with "
    "length 9!') }}{%- endif %}"
    "{{- ({'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson) }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ']</s>' }}"
    "{%- else %}"
    "{{- message.content + '</s>' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

#: :data:`HERMES` whose generation prompt after the tools' answers ends with :data:`REPLY_MARK`, so a
#: tool model made with ``reply`` (:func:`make_tool_model`) answers them in text, as a model that read
#: them would, and an agent's loop ends: the first turn calls, the turn after the results answers.
REPLY_MARK = "<answer>"
HERMES_REPLY = HERMES.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if messages[-1].role == 'tool' %}{{- '" + REPLY_MARK + "' }}{%- endif %}{%- endif %}")
assert HERMES_REPLY != HERMES
#: The answer of a model made with ``reply`` after the tools' answers (its own tokens, as ANSWER's).
REPLY = ["It is sunny", " in Paris", " at 14:05."]

#: A template that says ``<tool_call>`` but writes nothing of the tools it is given.
DEAF = "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}" \
       "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}" \
       "{#- answers may hold <tool_call> blocks #}"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]

#: The tool-calling tiny model's answer, as tokens of its own (added to the tiny tokenizer, as
#: real tokenizers have ``<tool_call>`` and many-character JSON pieces): two calls in a row.
ANSWER = ['<tool_call>\n{"name": "', "get_weather", '", "arguments": ', '{"city": "', "Paris",
          '"}}\n</tool_call>\n<tool_call>\n{"name":"', "get_time", '","arguments":', '{"tz":"CET"}}\n</tool_call>']


def make_tool_model(base, directory, template: str = HERMES, *, reply: list[str] | None = None):
    """A one-layer Llama that calls tools: a bigram model (each next token a function of the
    current one only: attention and MLP outputs zero, the head reading the token's own
    embedding), its table set so that after the assistant prompt it writes :data:`ANSWER` then
    ``<|im_end|>``, and after any token of ANSWER the one that follows it there. So a forced
    opening (``<tool_call>\\n{"name": "get_weather", "arguments": ``) is continued as ANSWER
    continues it. Its tokenizer: ``base``'s (the tiny model's) with ANSWER's tokens added and
    ``template`` as its chat template. ``reply``: after :data:`REPLY_MARK` (which
    :data:`HERMES_REPLY` writes after the tools' answers) it writes these tokens, then
    ``<|im_end|>``. Returns the folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from muser_cli.model.resolve import add_top_level_rope_theta, quiet_transformers

    tok = AutoTokenizer.from_pretrained(str(base.path))
    tok.add_tokens(ANSWER + ([REPLY_MARK] + reply if reply else []))
    tok.chat_template = template
    start = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                    tokenize=False)
    after_prompt = tok(start, add_special_tokens=False)["input_ids"][-1]
    seq = [after_prompt] + tok.convert_tokens_to_ids(ANSWER) + [tok.convert_tokens_to_ids("<|im_end|>")]
    chains = [seq]
    if reply:
        chains.append(tok.convert_tokens_to_ids([REPLY_MARK] + reply) + [seq[-1]])
    heads = [t for chain in chains for t in chain[:-1]]
    assert len(set(heads)) == len(heads), "the answer's tokens must each be followed by one token"
    hidden = 64
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with quiet_transformers(), torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(7)
        model = LlamaForCausalLM(config).eval()
        for layer in model.model.layers:  # the residual stream is the token's embedding, untouched
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        normed = emb / emb.pow(2).mean(-1, keepdim=True).add(config.rms_norm_eps).sqrt()
        head = torch.zeros_like(model.lm_head.weight)
        for chain in chains:
            for cur, nxt in zip(chain, chain[1:]):
                head[nxt] += 30.0 * normed[cur] / hidden  # logit 30 for the next token, ~±4 for others
        model.lm_head.weight.copy_(head)
        model.save_pretrained(str(directory))
        tok.save_pretrained(str(directory))
    add_top_level_rope_theta(directory)
    return directory
