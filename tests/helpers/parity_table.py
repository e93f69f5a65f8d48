"""The requests both vLLM's own server and ours answer in the parity test: every OpenAI feature the issue
names, on chat completions, completions, responses, tokenize/detokenize and models. Greedy, or sampled
with a seed, so that both servers must produce the same tokens."""

from __future__ import annotations

MODEL = "SmolLM2-135M-Instruct"
CHAT, CMPL, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
# Both servers get the same frontend flags (ours through serve.vllm_args): tool choice needs a parser.
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]

Q = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": Q, "max_tokens": 16, "temperature": 0, **kw}


def cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, **kw}


# (name, path, body or None for a GET, whether to send it streamed too)
TABLE: list[tuple[str, str, dict | None, bool]] = [
    ("chat_basic", CHAT, chat(), True),
    ("chat_parts", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Name three colours."}, {"type": "text", "text": "Be brief."}]}]), True),
    ("chat_multi_turn", CHAT, chat(messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to five."}]), True),
    ("chat_logprobs", CHAT, chat(logprobs=True, top_logprobs=3, max_tokens=8), True),
    ("chat_n2_seeded", CHAT, chat(n=2, temperature=0.8, seed=42, max_tokens=8), True),
    ("chat_json_schema", CHAT, chat(max_tokens=40, messages=[{"role": "user", "content": "A person, as JSON."}],
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "person", "schema": PERSON}}), True),
    ("chat_json_object", CHAT, chat(max_tokens=24, response_format={"type": "json_object"}), False),
    ("chat_regex", CHAT, chat(max_tokens=12, structured_outputs={"regex": "[0-9]{3}-[0-9]{4}"}), True),
    ("chat_choice", CHAT, chat(structured_outputs={"choice": ["Paris", "London", "Rome"]}), True),
    ("chat_tools_required", CHAT, chat(max_tokens=48, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=[WEATHER], tool_choice="required"), True),
    ("chat_tools_named", CHAT, chat(max_tokens=48, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                    tools=[WEATHER], tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}}), True),
    ("chat_tools_auto", CHAT, chat(tools=[WEATHER], tool_choice="auto"), False),
    ("chat_sampling_mix", CHAT, chat(stop=["\n\n"], stop_token_ids=[2], min_p=0.1, repetition_penalty=1.3,
                                     logit_bias={"504": -100}, min_tokens=3, max_completion_tokens=12,
                                     frequency_penalty=0.5, presence_penalty=0.3), True),
    ("chat_ignore_eos", CHAT, chat(ignore_eos=True, max_tokens=20), False),
    ("chat_continuous_usage", CHAT, chat(stream_options={"include_usage": True, "continuous_usage_stats": True},
                                         stream=True), False),
    ("cmpl_text", CMPL, cmpl(), True),
    ("cmpl_multi_prompt", CMPL, cmpl(prompt=["One, two,", "Red, green,"], max_tokens=6), True),
    ("cmpl_token_ids", CMPL, cmpl(prompt=[504, 3575, 282, 4649, 314], max_tokens=8), True),
    ("cmpl_echo_logprobs", CMPL, cmpl(echo=True, logprobs=2, max_tokens=4), True),
    ("cmpl_logprobs", CMPL, cmpl(logprobs=3, max_tokens=6), True),
    ("cmpl_prompt_logprobs", CMPL, cmpl(prompt_logprobs=2, max_tokens=3), False),
    ("cmpl_n2_seeded", CMPL, cmpl(n=2, temperature=1.0, seed=7, max_tokens=6), True),
    ("cmpl_regex", CMPL, cmpl(structured_outputs={"regex": "(yes|no)"}, max_tokens=4), False),
    ("cmpl_min_p_repetition_penalty", CMPL, cmpl(min_p=0.05, repetition_penalty=1.5, temperature=0.7, seed=3),
     False),
    ("cmpl_logit_bias_stop_token_ids", CMPL, cmpl(logit_bias={"7042": 100}, stop_token_ids=[7042]), False),
    ("responses_basic", RESP, {"model": MODEL, "input": "Say hello.", "max_output_tokens": 12, "temperature": 0},
     True),
    ("tokenize_text", "/tokenize", {"model": MODEL, "prompt": "Hello world"}, False),
    ("tokenize_chat", "/tokenize", {"model": MODEL, "messages": Q}, False),
    ("detokenize", "/detokenize", {"model": MODEL, "tokens": [19556, 905]}, False),
    ("models", "/v1/models", None, False),
    ("error_unknown_model", CHAT, chat(model="gpt-17"), True),
    ("error_too_many_logprobs", CMPL, cmpl(logprobs=50), False),
    ("error_too_long", CMPL, cmpl(prompt="word " * 3000), False),
    ("error_n2_greedy", CMPL, cmpl(n=2), False),
]
