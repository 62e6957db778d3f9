"""``pagestream gateway``: the OpenAI-compatible HTTP server alone (``pagestream serve`` adds a worker and
a Redis). Its options are shared with ``serve``."""
from __future__ import annotations

import logging
from typing import Optional

import typer

from pagestream.producer.protocol.cli import resolve_url
from pagestream.producer.protocol.redaction import install_log_redaction, redact_url
from pagestream.producer.protocol.settings import REDIS_URL_ENV

RedisUrl = typer.Option(None, "--redis-url", envvar=list(REDIS_URL_ENV), show_envvar=True,
                        show_default="gateway: redis://localhost:6379/0; serve: an embedded one",
                        help="Redis URL (a single node or any node of a Redis Cluster)")
Host = typer.Option("127.0.0.1", "--host", envvar="PAGESTREAM_GATEWAY_HOST", show_envvar=True, help="address the HTTP server binds")
Port = typer.Option(8000, "--port", envvar="PAGESTREAM_GATEWAY_PORT", show_envvar=True, help="port the HTTP server listens on")
ApiKeys = typer.Option(None, "--api-keys", envvar="PAGESTREAM_GATEWAY_API_KEYS", show_envvar=True, show_default="none needed",
                       help="comma-separated Bearer keys")
MaxQueueDepth = typer.Option(None, "--max-queue-depth", envvar="PAGESTREAM_GATEWAY_MAX_QUEUE_DEPTH", show_envvar=True,
                             show_default="no limit", help="answer 429 while a model has this many jobs waiting")

EnableAutoToolChoice = typer.Option(False, "--enable-auto-tool-choice", envvar="PAGESTREAM_GATEWAY_ENABLE_AUTO_TOOL_CHOICE",
                                    show_envvar=True,
                                    help="answer tool_choice 'auto' (vLLM's flag; needs --tool-call-parser)")
ToolCallParser = typer.Option(None, "--tool-call-parser", envvar="PAGESTREAM_GATEWAY_TOOL_CALL_PARSER", show_envvar=True,
                              show_default="none", help="how the model writes tool calls: hermes | llama3_json | mistral")
TrustRequestChatTemplate = typer.Option(False, "--trust-request-chat-template",
                                        envvar="PAGESTREAM_GATEWAY_TRUST_REQUEST_CHAT_TEMPLATE", show_envvar=True,
                                        help="render a chat_template sent with a request (vLLM's flag; refused with a "
                                             "400 otherwise): only for clients trusted to run a template on the workers")
EnablePromptTokensDetails = typer.Option(False, "--enable-prompt-tokens-details",
                                         envvar="PAGESTREAM_GATEWAY_ENABLE_PROMPT_TOKENS_DETAILS", show_envvar=True,
                                         help="usage.prompt_tokens_details.cached_tokens: prompt tokens served from "
                                              "the prefix cache (vLLM's flag)")
EnableTokenizerInfoEndpoint = typer.Option(False, "--enable-tokenizer-info-endpoint",
                                           envvar="PAGESTREAM_GATEWAY_ENABLE_TOKENIZER_INFO_ENDPOINT", show_envvar=True,
                                           help="answer GET /tokenizer_info: the tokenizer's configuration, chat "
                                                "template included (vLLM's flag; 404 otherwise)")


def gateway_settings(redis_url: str, host: str, port: int, api_keys: str | None, max_queue_depth: int | None,
                     enable_auto_tool_choice: bool | None = None, tool_call_parser: str | None = None,
                     trust_request_chat_template: bool | None = None,
                     enable_prompt_tokens_details: bool | None = None,
                     enable_tokenizer_info_endpoint: bool | None = None):
    """``GatewaySettings`` from the environment with the command line's options on top."""
    from pagestream.producer.gateway.settings import GatewaySettings

    fields = {"redis_url": redis_url, "host": host, "port": port, "api_keys": api_keys, "max_queue_depth": max_queue_depth,
              "enable_auto_tool_choice": enable_auto_tool_choice, "tool_call_parser": tool_call_parser,
              "trust_request_chat_template": trust_request_chat_template,
              "enable_prompt_tokens_details": enable_prompt_tokens_details,
              "enable_tokenizer_info_endpoint": enable_tokenizer_info_endpoint}
    return GatewaySettings(**{k: v for k, v in fields.items() if v is not None})


def gateway(
    redis_url: Optional[str] = RedisUrl,
    host: str = Host,
    port: int = Port,
    api_keys: Optional[str] = ApiKeys,
    max_queue_depth: Optional[int] = MaxQueueDepth,
    enable_auto_tool_choice: bool = EnableAutoToolChoice,
    tool_call_parser: Optional[str] = ToolCallParser,
    trust_request_chat_template: bool = TrustRequestChatTemplate,
    enable_prompt_tokens_details: bool = EnablePromptTokensDetails,
    enable_tokenizer_info_endpoint: bool = EnableTokenizerInfoEndpoint,
    log_level: str = typer.Option("INFO", "--log-level", envvar="PAGESTREAM_LOG_LEVEL", show_envvar=True, help="DEBUG | INFO | WARNING | ERROR"),
) -> None:
    """Serve the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions) over the queue."""
    from pagestream.producer.gateway.app import run

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    settings = gateway_settings(resolve_url(redis_url), host, port, api_keys, max_queue_depth, enable_auto_tool_choice,
                                tool_call_parser, trust_request_chat_template, enable_prompt_tokens_details,
                                enable_tokenizer_info_endpoint)
    print(f"gateway on http://{settings.host}:{settings.port}/v1 (redis {redact_url(settings.redis_url)})", flush=True)
    run(settings)
