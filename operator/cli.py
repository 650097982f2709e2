"""The ``gearshift`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid
from collections.abc import Sequence


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from gearshift.worker.server.settings import add_engine_args

    p.add_argument("--model", default="smollm2", help="model folder, .gguf file, or 'smollm2'")
    add_engine_args(p)


def _cmd_generate(args: argparse.Namespace) -> int:
    from gearshift.worker.errors import GearshiftError
    from gearshift.worker.launch import start_engine
    from gearshift.worker.policies.flags import policy_from_args
    from gearshift.worker.sampling.params import InvalidSamplingParams, SamplingParams
    from gearshift.worker.server.settings import engine_config
    from gearshift.worker.tokenizer.errors import TokenizerError

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        config = engine_config(args, show_progress=True)
        engine = start_engine(config, policy_from_args(args))
        assert engine.tokenizer is not None
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.prompt})
            prompt: list[int] | str = engine.tokenizer.apply_chat_template(messages)
        else:
            prompt = args.prompt
        engine.add_request(uuid.uuid4().hex, prompt, params)
    except (GearshiftError, InvalidSamplingParams, TokenizerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finish, error = None, None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.finished:
                    finish, error = out.finish_reason, out.error
    finally:
        engine.shutdown()
    sys.stdout.write("\n")
    if finish is not None and finish.value not in ("stop", "length"):
        print(f"error: generation ended with {finish.value}: {error}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gearshift", description=__doc__)
    parser.add_argument(
        "--log-level",
        default=None,
        help="default: INFO for the servers (start-up stages, as vLLM logs), WARNING otherwise",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    from gearshift.worker.policies.flags import add_policy_args

    add_policy_args(gen, world_size=True)
    gen.set_defaults(func=_cmd_generate)
    # The serving commands live in their own modules (gearshift.operator.commands).
    from gearshift.operator.commands import (
        fetch_model,
        plan,
        profile,
        router,
        serve,
        tetris_profile,
        worker,
    )

    for command in (worker, router, serve, fetch_model, profile, tetris_profile, plan):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level or ("WARNING" if args.command == "generate" else "INFO")
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        # The operator image and `pip install gearshift` carry no engine (pyproject: extras).
        print(
            f"error: `gearshift {args.command}` runs the engine, which needs torch: "
            "pip install 'gearshift[worker]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
