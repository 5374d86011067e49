"""``erft probe``: Paper A's first-order entropy dynamics, predicted vs exact, on a real distribution."""

from __future__ import annotations

import argparse

from entropy_rft.cli.flags import add_sampling_flags
from entropy_rft.common.errors import UserError

NAME = "probe"
HELP = (
    "Check Paper A's entropy dynamics on real distributions: predicted vs actual entropy change for "
    "single-logit and GRPO updates, O(eps^2) error, sign agreement, Corollaries 3.4 and 3.5."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="synthetic",
                        help="'synthetic' (seeded random logits, no model), 'default', 'default-strong', "
                             "'smollm2-135m', a local model folder or a hub id")
    parser.add_argument("--text", default=None, help="text whose next-token distributions are probed "
                                                     "(real models; default: a built-in paragraph)")
    parser.add_argument("--positions", type=int, default=256, help="number of positions (rows) to probe")
    parser.add_argument("--eps", type=float, default=0.05,
                        help="update size eps (single logit) and |alpha| (GRPO); halved --halvings times")
    parser.add_argument("--halvings", type=int, default=2, help="how many times eps is halved (>= 1)")
    add_sampling_flags(parser, "--temperature", temperature={"default": 1.0, "help": "sampling temperature of p"})
    parser.add_argument("--vocab-sizes", default=None, metavar="V1,V2,...",
                        help="synthetic only: comma list of vocabulary sizes (default 50,1000,32000,151936)")
    add_sampling_flags(parser, "--seed", "--device", seed={"help": "seed for synthetic logits and sampled tokens"},
                       device={"help": "device for a real model's forward pass"})
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    from entropy_rft.common.comma_lists import parse_int_list
    from entropy_rft.training import preflight

    if args.vocab_sizes is not None and args.model != "synthetic":
        raise UserError("--vocab-sizes applies only to --model synthetic; drop it or use --model synthetic")
    vocab_sizes = (None if args.vocab_sizes is None
                   else tuple(parse_int_list(args.vocab_sizes, "--vocab-sizes", "50,1000")))
    if args.text is not None and not args.text.strip():
        raise UserError("--text is empty; give the text to probe, or leave --text out for the built-in paragraph")
    preflight.check_min("--seed", args.seed, 0)
    preflight.check_device(args.device, "--device", "--device cpu")
    if args.json is not None:
        preflight.check_out_file(args.json, "--json")
    if args.model != "synthetic":
        preflight.check_model(args.model)

    import torch
    from rich.console import Console

    from entropy_rft.analysis import theory_probe as tp

    cfg = tp.ProbeConfig(
        model=args.model, positions=args.positions, eps=args.eps, halvings=args.halvings, seed=args.seed,
        temperature=args.temperature, text=args.text, device=args.device,
        vocab_sizes=vocab_sizes or tp.SYNTHETIC_VOCABS,
    )
    tp.validate(cfg)
    threads = torch.get_num_threads()
    result = tp.run_probe(cfg)
    Console().print(tp.render(result))
    if args.json:
        tp.write_json_atomic(args.json, result)
    torch.set_num_threads(threads)
    return 0
