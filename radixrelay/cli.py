"""radixrelay: an LLM serving runtime for workloads that share prompts (radix prefix cache, cascaded attention).

Subcommands: ``serve`` runs the OpenAI-compatible HTTP server; ``generate`` answers one prompt offline. Heavy
imports happen inside the subcommands, so ``--help`` is instant."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from radixrelay.config import (
    ATTENTION_BACKENDS, CASCADE_MODES, DEVICES, DTYPES, KV_CACHE_DTYPES, KV_TIER_POLICIES, LOAD_FORMATS, LOG_LEVELS,
    NODE_KERNELS, QUANTIZATIONS, REASONING_PARSERS, TOOL_CALL_PARSERS, EngineConfig, ServerConfig,
)
from radixrelay.env import api_key_env


def _engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and runtime")
    g.add_argument("--model", default="default",
                   help="'default' (the embedded SmolLM2-135M-Instruct), a local HF model directory "
                        "or a .gguf file (default: %(default)s)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer to use instead of the model's own: 'default', a local HF "
                        "directory or a .gguf file, e.g. with --load-format dummy for a directory "
                        "holding only config.json (default: the model's)")
    g.add_argument("--device", default="auto",
                   help=f"one of {', '.join(DEVICES)} or cuda:N (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and KV dtype; auto: float32 on CPU, bfloat16 on CUDA (default: %(default)s)")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="weight format; dummy: random weights (default: %(default)s)")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="KV cache capacity in tokens (default: 32768 on CPU, memory fraction on CUDA)")
    kv.add_argument("--kv-memory-fraction", type=float, default=0.85,
                    help="CUDA: share of the memory free after loading the model used for the KV "
                         "cache (default: %(default)s)")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="split the model over this many GPUs (one worker process each; rank r on cuda:r), or "
                        "processes on the CPU (default: %(default)s)")
    g.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="fp8: the decoder's linear layers in float8 e4m3 (weights per output channel, inputs per "
                        "token; bf16 checkpoints quantized at load, FP8 checkpoints loaded as they are); needs FP8 "
                        "tensor cores, e.g. H100 (default: the model dtype)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="fp8: K and V stored in float8 e4m3 (twice the tokens in the same memory; scale 1 on "
                        "the GPU, read by the attention kernels as the model dtype); auto: the model dtype "
                        "(default: %(default)s)")
    g.add_argument("--fp8-keep-layers", type=_layer_list, default=(), metavar="I,J,...",
                   help="with --quantization fp8: decoder layers whose projections stay in the model dtype, "
                        "by index (negative from the end: -1 is the last layer) (default: none)")
    g.add_argument("--fp8-emulation", action="store_true",
                   help="run --quantization / --kv-cache-dtype fp8 as quantize-then-dequantize in float32: FP8's "
                        "numbers without FP8 hardware (e.g. on the CPU, to check accuracy), not its speed")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    g.add_argument("--max-running-requests", type=int, default=256,
                   help="most requests decoding at once (default: %(default)s)")
    g.add_argument("--chunked-prefill-tokens", type=int, default=2048,
                   help="per-step token budget of prefill chunks (default: %(default)s)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention implementation; auto: triton on CUDA, torch on CPU "
                        "(default: %(default)s)")
    g.add_argument("--cascade", default="auto", choices=CASCADE_MODES,
                   help="cascaded attention over shared prefixes: auto decides per step by a cost "
                        "model, on cascades every shared node, off is flat (default: %(default)s)")
    g.add_argument("--node-kernel", default="auto", choices=NODE_KERNELS,
                   help="kernel of shared decode nodes: auto and triton run the Triton kernel (faster in "
                        "the cascade where measured); fa3 runs FlashAttention-3 (pip install "
                        "'radixrelay[fa3]'; Hopper, 16-bit KV cache) (default: %(default)s)")
    g.add_argument("--disable-cuda-graphs", action="store_true",
                   help="run decode steps eagerly instead of as captured CUDA graphs")
    g.add_argument("--disable-radix-cache", action="store_true",
                   help="never reuse cached prefixes")
    g.add_argument("--pinned-kv-tokens", type=int, default=None, metavar="N",
                   help="most KV tokens pinned prefixes may hold (prompt_cache_retention \"24h\", cache_control "
                        "marks); a pin past it is refused with a 400; 0 refuses every pin (default: a quarter of "
                        "the KV cache)")
    g.add_argument("--pin-ttl-scale", type=float, default=1.0, metavar="FACTOR",
                   help="multiply every pin's time-to-live by FACTOR, e.g. 0.001 for tests (default: %(default)s)")
    g.add_argument("--enable-priority", action="store_true",
                   help="let requests set `priority` (an integer, smaller runs first); without it a non-zero "
                        "priority is refused with a 400")
    g.add_argument("--priority-ageing", type=float, default=5.0, metavar="SECONDS", dest="priority_ageing_s",
                   help="with --enable-priority, a queued request counts one priority level higher for every "
                        "SECONDS it has waited, so none starves (default: %(default)s)")
    g.add_argument("--disable-overlap", action="store_true",
                   help="run the scheduler and worker in lock step (one step in flight) instead of "
                        "overlapping the next step's planning and launch with the device's work; "
                        "for debugging and comparison")
    t = parser.add_argument_group("KV tiers (host memory and disk behind the radix cache)")
    t.add_argument("--host-kv-gib", type=float, default=None,
                   help="host memory for KV pages evicted from the device, in GiB; 0 turns the tiers off "
                        "(default: 0 on the CPU, 1 there with --disk-kv-path to stage its pages; on CUDA 40%% "
                        "of available RAM, at most 64, pinned)")
    t.add_argument("--disk-kv-path", default=None,
                   help="directory for a disk tier below host memory (default: no disk tier); pages are "
                        "keyed by model and KV layout, so a restart with the same path reuses them")
    t.add_argument("--disk-kv-gib", type=float, default=None,
                   help="disk tier capacity in GiB; at start-up it must fit the directory's free space plus "
                        "the files already there (default: 64, or 90%% of that space if less)")
    t.add_argument("--kv-tier-policy", default="scheduler", choices=KV_TIER_POLICIES,
                   help="host-memory eviction: 'scheduler' spares the pages of queued requests, 'lru' "
                        "does not (default: %(default)s)")
    g.add_argument("--context-length", type=int, default=None,
                   help="context window in tokens, at most the model's (default: the model's)")
    g.add_argument("--truncation", type=float, default=None, metavar="RATIO",
                   help="context overflow: a prompt that does not fit loses its oldest tokens in chunks "
                        "of RATIO x the context instead of being refused; the KV tiers keep the kept "
                        "tokens' cached KV usable, re-positioned (default: off, such prompts get a 400)")
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling (default: %(default)s)")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
        load_format=args.load_format,
        kv_cache_tokens=args.kv_cache_tokens, kv_memory_fraction=args.kv_memory_fraction,
        page_size=args.page_size, max_running_requests=args.max_running_requests,
        max_queued_requests=getattr(args, "max_queued_requests", 1024),
        chunked_prefill_tokens=args.chunked_prefill_tokens,
        attention_backend=args.attention_backend, cascade=args.cascade, node_kernel=args.node_kernel,
        disable_cuda_graphs=args.disable_cuda_graphs, disable_radix_cache=args.disable_radix_cache,
        disable_overlap=args.disable_overlap, host_kv_gib=args.host_kv_gib, disk_kv_path=args.disk_kv_path,
        disk_kv_gib=args.disk_kv_gib, kv_tier_policy=args.kv_tier_policy,
        context_length=args.context_length, truncation=args.truncation, seed=args.seed, tp=args.tp,
        kv_events=getattr(args, "kv_events", None), kv_events_name=_kv_events_name(args),
        kv_events_key_file=getattr(args, "kv_events_key_file", None),
        kv_events_password_file=getattr(args, "kv_events_password_file", None),
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, fp8_emulation=args.fp8_emulation,
        fp8_keep_layers=args.fp8_keep_layers, pinned_kv_tokens=args.pinned_kv_tokens,
        pin_ttl_scale=args.pin_ttl_scale, enable_priority=args.enable_priority,
        priority_ageing_s=args.priority_ageing_s)


def _layer_list(text: str) -> tuple[int, ...]:
    """'0,-1' -> (0, -1): layer indices for --fp8-keep-layers."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices separated by commas, e.g. -1 or 0,-1; got {text!r}")


def _kv_events_name(args: argparse.Namespace) -> str | None:
    """``--kv-events-name``, else the server's own URL (a wildcard address named by this host's name)."""
    if getattr(args, "kv_events", None) is None:
        return None
    if args.kv_events_name:
        return args.kv_events_name.rstrip("/")
    host = args.host
    if host in ("0.0.0.0", "::", ""):
        import socket

        host = socket.getfqdn()
    return f"http://{'[' + host + ']' if ':' in host else host}:{args.port}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixrelay", description=__doc__.split("\n\n")[0],
                                     epilog="'radixrelay COMMAND --help' lists a command's options.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Run the OpenAI-compatible HTTP server.")
    _engine_args(serve)
    g = serve.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=30000, help="port to listen on (default: %(default)s)")
    key = g.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/*, /flush_cache, /tokenize and "
                          "/detokenize (visible to every user in the process list: prefer --api-key-file or "
                          "RADIXRELAY_API_KEY)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="like --api-key, the key read from the first line of this file")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="most requests waiting for admission; more get HTTP 429 (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must send and /v1/models lists (default: the --model value)")
    _chat_template_arg(g)
    g.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="the format of tool calls in the model's output: hermes (<tool_call> tags: Qwen, Hermes), "
                        "llama3_json, mistral ([TOOL_CALLS][...]), mistral_args ([TOOL_CALLS]name[ARGS]...); auto: from the "
                        "chat template (default: %(default)s)")
    g.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                   help="think: reasoning inside <think>...</think> is returned as reasoning_content; auto: think "
                        "when the chat template writes </think> (default: %(default)s)")
    g.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for (default: %(default)s)")
    g.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="larger request bodies get HTTP 413 (default: %(default)s)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish (default: %(default)s)")
    g.add_argument("--api-servers", type=int, default=1, metavar="N",
                   help="HTTP server processes sharing the port (SO_REUSEPORT) and the runtime: requests are "
                        "read, parsed and tokenized on N event loops; connection limits are per process "
                        "(default: %(default)s)")
    _connection_args(g)
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: %(default)s)")
    g.add_argument("--kv-events", default=None, metavar="redis://HOST:PORT/DB",
                   help="publish the radix tree's page keys and the server's load to this Redis store, for "
                        "routers in precise mode (docs/router.md) (default: none)")
    g.add_argument("--kv-events-name", default=None, metavar="URL",
                   help="the URL routers know this server by, in its KV events (default: http://HOST:PORT)")
    g.add_argument("--kv-events-key-file", default=None, metavar="PATH",
                   help="sign every KV event with the key on this file's first line (HMAC-SHA256; routers with "
                        "--store-key-file of the same key then trust them) (default: unsigned)")
    g.add_argument("--kv-events-password-file", default=None, metavar="PATH",
                   help="the --kv-events store's password, on this file's first line (default: none)")

    router = sub.add_parser("router", help="route requests over several servers by cached prefix",
                            description="Run an OpenAI-compatible router in front of several radixrelay "
                                        "servers (replicas): each request goes to the replica most likely to "
                                        "hold its prompt's prefix, weighed against load (docs/router.md).")
    g = router.add_argument_group("router")
    g.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:30000 (repeat for each); with --mode precise, "
                        "replicas started with --kv-events also announce themselves")
    g.add_argument("--mode", default="approximate", choices=("precise", "approximate", "round-robin"),
                   help="precise: by what the replicas report holding (KV events in --store); approximate: by "
                        "what this router sent where; round-robin: in turn (default: %(default)s)")
    g.add_argument("--store", default=None, metavar="redis://HOST:PORT/DB",
                   help="the Redis store the replicas publish KV events to (--kv-events; rediss:// over TLS); "
                        "needed by --mode precise")
    g.add_argument("--replica-pattern", default=None, metavar="REGEX",
                   help="precise mode: replicas whose announced name (URL) fully matches this regular expression "
                        "may join the pool; without it (or --store-key-file) only --replica URLs are trusted")
    g.add_argument("--store-key-file", default=None, metavar="PATH",
                   help="trust only KV events signed with the key on this file's first line (serve "
                        "--kv-events-key-file); signed announcements may join the pool (default: unsigned)")
    g.add_argument("--store-password-file", default=None, metavar="PATH",
                   help="the --store's password, on this file's first line (default: none)")
    g.add_argument("--tokenizer", default="default",
                   help="the replicas' tokenizer: a .gguf file, a Hugging Face directory, or 'default' (the "
                        "embedded model's) (default: %(default)s)")
    _chat_template_arg(g)
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=30080, help="port to listen on (default: %(default)s)")
    _connection_args(g)
    # the limits as a proxy (radixrelay.router.proxy.ProxyLimits: the same defaults, checked there)
    g.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                   help="larger request bodies get HTTP 413, as on the server (default: %(default)s)")
    g.add_argument("--max-response-bytes", type=int, default=64 * 1024 * 1024,
                   help="a replica's whole answer larger than this is a 502 to the client; a stream is relayed "
                        "as it arrives, with no total (default: %(default)s)")
    g.add_argument("--upstream-connect-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="to connect to a replica; past it, HTTP 504 and the replica leaves the pool "
                        "(default: %(default)s)")
    g.add_argument("--upstream-read-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="the longest a replica may stay silent (before its answer or between two bytes of it); "
                        "past it, HTTP 504, or an error event in a stream (default: %(default)s)")
    g.add_argument("--max-in-flight", type=int, default=4096,
                   help="most requests in the router at once; more get HTTP 429 (default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: %(default)s)")

    gen = sub.add_parser("generate", help="answer one prompt offline and print the text",
                         description="Answer one prompt offline (no server) and print the text as it is "
                                     "generated. The prompt is a user message rendered with the model's "
                                     "chat template; --raw continues the text as it is instead.")
    _engine_args(gen)
    g = gen.add_argument_group("generation")
    g.add_argument("--prompt", default="What is the capital of France?", help="(default: %(default)r)")
    g.add_argument("--raw", action="store_true",
                   help="complete the prompt text as it is, without the chat template")
    _chat_template_arg(g)
    g.add_argument("--max-tokens", type=int, default=32, help="(default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    return parser


def _connection_args(group: argparse._ArgumentGroup) -> None:
    """The connection limits of ``serve`` and ``router`` (radixrelay.net.connections)."""
    group.add_argument("--request-read-timeout", type=float, default=ServerConfig.request_read_timeout,
                       metavar="SECONDS",
                       help="a request's headers and body must arrive within this many seconds of its first byte, "
                            "else HTTP 408 and the connection is closed; responses (streams) are not limited by "
                            "it (default: %(default)s)")
    group.add_argument("--max-connections", type=int, default=None, metavar="N",
                       help="most open client connections; more get HTTP 503 and are closed at once (default: "
                            "from the descriptor limit, raised to the hard limit at start-up, less a reserve)")


def _chat_template_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--chat-template", default=None,
                       help="Jinja chat template, as a file path or inline text (default: the model's)")


def _api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else the first line of ``--api-key-file``, else ``RADIXRELAY_API_KEY``, else None."""
    if args.api_key is not None:
        return args.api_key
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file: {args.api_key_file} holds no key on its first line")
        return key
    return api_key_env()


def _template_text(value: str | None) -> str | None:
    if value is not None and Path(value).is_file():
        return Path(value).read_text(encoding="utf-8")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "router":
        return _router(args)
    try:
        engine_config = _engine_config(args)
        from radixrelay.runtime.preflight import check_startup

        check_startup(engine_config)       # environment variables, --tp against the model: before anything starts
        if args.command == "serve":
            server_config = ServerConfig(
                host=args.host, port=args.port, api_key=_api_key(args),
                served_model_name=args.served_model_name,
                chat_template=_template_text(args.chat_template), max_n=args.max_n,
                tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                max_body_bytes=args.max_body_bytes, drain_timeout=args.drain_timeout,
                log_level=args.log_level, request_read_timeout=args.request_read_timeout,
                max_connections=args.max_connections, api_servers=args.api_servers)
    except ValueError as exc:
        print(f"radixrelay: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve" and engine_config.kv_events is not None:
        from radixrelay.kv_auth import read_key
        from radixrelay.kv_store import connect, read_password

        try:                                               # before loading anything: a clear start-up error
            if engine_config.kv_events_key_file is not None:
                read_key(engine_config.kv_events_key_file, "--kv-events-key-file")
            password = read_password(engine_config.kv_events_password_file, "--kv-events-password-file")
            connect(engine_config.kv_events, password=password).close()
        except (ConnectionError, ValueError) as exc:
            print(f"radixrelay: error: --kv-events: {exc}", file=sys.stderr)
            return 2
    if args.command == "serve":
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from radixrelay.server.serve import run_server
        return run_server(engine_config, server_config)
    return _generate(engine_config, args)


def _router(args: argparse.Namespace) -> int:
    from radixrelay.model.model_registry import resolve_model_path
    from radixrelay.net.connections import ConnectionLimits
    from radixrelay.router.router_app import RouterConfig, run_router
    from radixrelay.router.prompt import PromptKeys
    from radixrelay.router.replicas import check_replica_url
    from radixrelay.text.chat_template import ChatTemplate
    from radixrelay.text.tokenizer import load_tokenizer

    try:
        config = RouterConfig(tuple(check_replica_url(u) for u in args.replica), args.mode, store=args.store,
                              replica_pattern=args.replica_pattern, store_key_file=args.store_key_file,
                              store_password_file=args.store_password_file, limits=_proxy_limits(args))
        # two descriptors per connection (its upstream one); raises the descriptor limit
        connections = ConnectionLimits(args.request_read_timeout, args.max_connections, 2).resolved()
        tokenizer = load_tokenizer(resolve_model_path(args.tokenizer))
        template = _template_text(args.chat_template)
        chat = ChatTemplate.for_tokenizer(tokenizer, template) if template or tokenizer.chat_template else None
        events = None
        if config.store is not None:
            from radixrelay.kv_store import read_password
            from radixrelay.router.kv_index import KVEventIndex
            from radixrelay.router.trust import make_trust

            trust = make_trust(config.replicas, config.replica_pattern, config.store_key_file)
            password = read_password(config.store_password_file, "--store-password-file")
            events = KVEventIndex(config.store, trust=trust, password=password)   # ConnectionError if no answer
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"radixrelay router: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_router(config, PromptKeys(tokenizer, chat), args.host, args.port, args.log_level, events,
                      connections=connections)


def _proxy_limits(args: argparse.Namespace):
    """The router's limits as a proxy (``ValueError`` for a bad value)."""
    from radixrelay.router.proxy import ProxyLimits

    return ProxyLimits(max_body_bytes=args.max_body_bytes, max_response_bytes=args.max_response_bytes,
                       upstream_connect_timeout=args.upstream_connect_timeout,
                       upstream_read_timeout=args.upstream_read_timeout, max_in_flight=args.max_in_flight)


def generate_prompt(tokenizer, text: str, *, raw: bool, chat_template: str | None = None) -> str | list[int]:
    """What ``generate`` submits: ``text`` itself with ``raw``, else the token ids of ``text`` as a user
    message rendered with the chat template (``chat_template`` or the tokenizer's)."""
    from radixrelay.text.chat_template import ChatTemplate

    if raw:
        return text
    rendered = ChatTemplate.for_tokenizer(tokenizer, chat_template).render([{"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_special_tokens=False)       # the template has BOS if any


def _generate(engine_config: EngineConfig, args: argparse.Namespace) -> int:
    from radixrelay import Engine, SamplingParams

    with Engine(**{**engine_config.__dict__}) as engine:
        try:
            prompt = generate_prompt(engine.tokenizer, args.prompt, raw=args.raw,
                                     chat_template=_template_text(args.chat_template))
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
            for delta in engine.generate_stream(prompt, params):
                print(delta, end="", flush=True)
        except ValueError as exc:
            print(f"\nradixrelay: error: {exc}", file=sys.stderr)
            return 2
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
