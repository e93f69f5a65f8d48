"""A tools request on a deployment without a tool-call parser: the 400 names our setting (serve.vllm_args) and
an example, not vLLM's CLI flags, which our deploy CLI does not have. vLLM's own ErrorResponse, no server."""

from __future__ import annotations

import asyncio

from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

from cluster.config import SLOConfig
from cluster.serve.preflight import admit_streams_first, our_setting_named


def _vllm_error(message: str) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type="BadRequestError", code=400))


def test_the_tool_parser_error_names_our_setting_and_an_example():
    async def create_chat_completion(request, raw_request=None):
        return _vllm_error('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')

    wrapped = admit_streams_first(create_chat_completion, SLOConfig())
    out = asyncio.run(wrapped(object()))
    msg = out.error.message
    assert msg.startswith('"auto" tool choice needs a tool-call parser')
    assert "serve: {vllm_args: [--enable-auto-tool-choice, --tool-call-parser, hermes]}" in msg
    assert " requires " not in msg and out.error.param == "tool_choice" and out.error.code == 400


def test_a_named_tool_choice_keeps_its_name_and_other_errors_are_left_alone():
    named = our_setting_named(_vllm_error('tool_choice=function "get_weather" requires --tool-call-parser to be set'))
    assert named.error.message.startswith('tool_choice=function "get_weather" needs a tool-call parser')
    other = our_setting_named(_vllm_error("The model `x` does not exist."))
    assert other.error.message == "The model `x` does not exist." and other.error.param is None
