"""``python -m trainer model {prepare,tiny}``: make a stock checkpoint trainable, or write a tiny stock one.

``prepare --from DIR --out DIR [--init number|mean] [--pad-to-multiple-of N]`` adds the coord tokens and their
embedding rows (``trainer.modeling.prepare``); ``tiny --out DIR [--vl]`` saves the embedded tiny model as a stock
checkpoint (no coord tokens), so the whole sequence runs on a CPU without a model hub.
"""

from __future__ import annotations

import argparse
import sys


def run_prepare(args: argparse.Namespace) -> int:
    from trainer.modeling.prepare import PrepareRefused, prepare_checkpoint

    try:
        r = prepare_checkpoint(args.source, args.out, args.init, args.pad_to_multiple_of)
    except PrepareRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not r.written:
        print(f"already prepared: {r.out} holds {r.source} prepared ({r.init or 'unchanged'}); nothing to do")
    elif r.already_prepared:
        print(f"already prepared: {r.source} has the 1000 coord tokens and {r.rows_after} embedding rows; "
              f"copied unchanged to {r.out}")
    else:
        print(f"prepared {r.out}: {r.tokens_added} coord tokens (ids {r.first_coord_id}..{r.first_coord_id + 999}), "
              f"embeddings {r.rows_before} -> {r.rows_after} rows ({'tied' if r.tied_embeddings else 'untied'}), "
              f"init {r.init}; record: {r.out}/prepare.json")
    return 0


def run_tiny(args: argparse.Namespace) -> int:
    from trainer.modeling.fixtures import TinyShape, save_tiny_model
    from trainer.modeling.prepare import prepare_command

    try:
        given = {"hidden_size": args.hidden_size, "num_hidden_layers": args.layers,
                 "vision_hidden_size": args.vision_hidden_size, "vision_depth": args.vision_depth,
                 "max_pixels": args.max_pixels}
        shape = TinyShape(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        print(f"error: model tiny: {exc}", file=sys.stderr)
        return 2
    out = save_tiny_model(args.out, "vl" if args.vl else "text", args.seed, stock=True, vocab_rows=args.vocab_rows,
                          tied=not args.untied, shape=shape)
    print(f"wrote a tiny stock {'Qwen3-VL' if args.vl else 'Qwen3'} checkpoint (no coord tokens) to {out}; next: "
          + prepare_command(out))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("model", help="prepare a stock checkpoint (coord tokens + embedding rows), or write a "
                                            "tiny stock one")
    sub = p.add_subparsers(dest="model_command", metavar="{prepare,tiny}")
    sub.required = True
    prep = sub.add_parser("prepare", help="add <|coord_0|>..<|coord_999|> to a stock checkpoint's tokenizer, grow "
                                          "and initialise its embeddings, write a new checkpoint")
    prep.add_argument("--from", dest="source", required=True, metavar="DIR", help="the stock HF checkpoint directory")
    prep.add_argument("--out", required=True, metavar="DIR", help="where the prepared checkpoint goes (new directory)")
    prep.add_argument("--init", choices=("number", "mean"), default="number",
                      help="number: each <|coord_k|> row from the stock rows of the spelling of k (place-weighted "
                           "mean); mean: the plain mean of the stock rows (default: number)")
    prep.add_argument("--pad-to-multiple-of", type=int, default=1, metavar="N",
                      help="round the embedding rows up to a multiple of N (default 1: as many as the tokenizer "
                           "needs, never fewer than the stock rows)")
    prep.set_defaults(func=run_prepare)
    tiny = sub.add_parser("tiny", help="save the embedded tiny model as a stock checkpoint (no coord tokens; CPU, "
                                       "no hub)")
    tiny.add_argument("--out", required=True, metavar="DIR")
    tiny.add_argument("--vl", action="store_true", help="a tiny random Qwen3-VL (with its image processor)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--vocab-rows", type=int, default=None, metavar="N",
                      help="at least N embedding rows (spare rows beyond the tokenizer, as Qwen's padded vocabularies)")
    tiny.add_argument("--untied", action="store_true", help="a separate LM head (tie_word_embeddings: false)")
    for flag, what in (("--hidden-size", "the language model's hidden size, a multiple of 64"),
                       ("--layers", "the language model's layers"),
                       ("--vision-hidden-size", "the vision tower's hidden size, a multiple of 64 (--vl)"),
                       ("--vision-depth", "the vision tower's blocks (--vl)"),
                       ("--max-pixels", "the image processor's largest image in pixels (--vl)")):
        tiny.add_argument(flag, type=int, default=None, metavar="N",
                          help=f"{what} (default: the embedded test fixture's, as model.tiny_shape)")
    tiny.set_defaults(func=run_tiny)
