"""Turn a stock checkpoint into one the trainer loads: add ``<|coord_0|>``…``<|coord_999|>`` to its tokenizer, grow
the input and output embeddings to match, initialise the new rows, and write an ordinary HF checkpoint directory.

Contracts:
- the source is never modified; the output is written to a temporary sibling and renamed into place, so ``--out``
  is either absent, or a complete checkpoint with ``prepare.json`` (what was done);
- ``number`` init (default): coord token k's input row is the place-weighted mean of the stock input rows of the
  stock tokenizer's pieces of the decimal ``str(k)`` (weights 1, 1/2, 1/4, … from the first piece, normalised),
  and its LM-head row the same mean of the LM-head rows (one step when the embeddings are tied); ``mean``: every
  coord row is the plain mean of the stock tokenizer's rows; rows beyond the tokenizer (``pad_to_multiple_of``)
  get that plain mean too;
- every coord row is written, including coord ids that fall into spare rows the stock vocabulary already had;
- an already prepared source is reported and copied unchanged; ``PrepareRefused`` (one line) for a missing
  directory, no tokenizer, an unknown architecture, no chat template, partial coord tokens, or coord tokens without
  their embedding rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

import torch

from trainer.data.output_format import all_coord_tokens
from trainer.modeling.tokenizer import missing_coord_bins

InitMethod = Literal["number", "mean"]
INIT_METHODS: tuple[str, ...] = ("number", "mean")
RECORD = "prepare.json"
VL_MODEL_TYPES = {"qwen3_vl", "qwen2_5_vl", "qwen2_vl", "qwen3_vl_moe"}
#: files the model's and tokenizer's ``save_pretrained`` write; everything else at the source's top level is copied
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
REWRITTEN = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "added_tokens.json", RECORD, ".tiny-complete"}


#: a prepared checkpoint's directory is its stock directory's name with this suffix (``Qwen3-VL-2B-Instruct`` ->
#: ``Qwen3-VL-2B-Instruct-coord``): what the hints print, the presets' ``model.path`` and the CPU configs use
PREPARED_SUFFIX = "-coord"


def prepared_dir(source: str | os.PathLike[str]) -> str:
    """Where ``model prepare`` writes ``source`` prepared, by the one naming convention (``PREPARED_SUFFIX``)."""
    return f"{os.fspath(source).rstrip('/')}{PREPARED_SUFFIX}"


def prepare_command(source: str | os.PathLike[str]) -> str:
    """The ``python -m trainer model prepare`` line for ``source``, written to ``prepared_dir(source)``."""
    return f"python -m trainer model prepare --from {os.fspath(source)} --out {prepared_dir(source)}"


class PrepareRefused(ValueError):
    """A checkpoint ``prepare`` cannot handle; the message is one line naming the item and what to do."""


@dataclass(frozen=True)
class PrepareResult:
    source: str
    out: str
    model_type: str
    init: str | None
    tokens_added: int
    first_coord_id: int
    rows_before: int
    rows_after: int
    tied_embeddings: bool
    already_prepared: bool
    written: bool


def _load_config(src: Path):
    from transformers import AutoConfig

    if not src.is_dir():
        raise PrepareRefused(f"--from {src}: no such directory; point it at a local HF checkpoint")
    if not (src / "config.json").is_file():
        raise PrepareRefused(f"--from {src}: no config.json; point it at a local HF checkpoint directory")
    try:
        return AutoConfig.from_pretrained(src)
    except (ValueError, KeyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PrepareRefused(f"--from {src}: unknown architecture ({first}); supported: Qwen2/2.5/3-VL and "
                             "transformers' causal LMs") from None


def _is_supported(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config.model_type in VL_MODEL_TYPES or config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _chat_template_file(src: Path) -> str | None:
    """The template a processor-style checkpoint keeps beside the tokenizer (``chat_template.jinja`` / ``.json``)."""
    if (src / "chat_template.jinja").is_file():
        return (src / "chat_template.jinja").read_text(encoding="utf-8")
    if (src / "chat_template.json").is_file():
        return json.loads((src / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    return None


def _load_tokenizer(src: Path):
    from transformers import AutoTokenizer

    if not any((src / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise PrepareRefused(f"--from {src}: no tokenizer (tokenizer.json / tokenizer_config.json); copy the stock "
                             "tokenizer files into the checkpoint directory")
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (ValueError, OSError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PrepareRefused(f"--from {src}: the tokenizer does not load ({first})") from None
    if not tok.chat_template:
        tok.chat_template = _chat_template_file(src)
    if not tok.chat_template:
        raise PrepareRefused(f"--from {src}: the tokenizer has no chat template (the prompts are built with it); "
                             "use an instruct/chat checkpoint or add chat_template.jinja")
    return tok


def _load_model(src: Path, config):
    if config.model_type in VL_MODEL_TYPES:
        from transformers import AutoModelForImageTextToText as Auto
    else:
        from transformers import AutoModelForCausalLM as Auto
    return Auto.from_pretrained(src, dtype="auto")


def _rows(model) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def is_tied(model) -> bool:
    out = model.get_output_embeddings()
    return out is None or out.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def place_weights(n: int) -> torch.Tensor:
    """``1, 1/2, 1/4, …`` over ``n`` pieces, normalised to sum 1 (the leading digits dominate)."""
    w = torch.tensor([0.5**i for i in range(n)], dtype=torch.float32)
    return w / w.sum()


def number_spellings(tokenizer) -> list[list[int]]:
    """The stock tokenizer's ids of the decimal spelling of each bin ``0``…``999``."""
    return [list(tokenizer(str(k), add_special_tokens=False)["input_ids"]) for k in range(len(all_coord_tokens()))]


def coord_rows(weight: torch.Tensor, spellings: list[list[int]], stock_rows: int, init: str) -> torch.Tensor:
    """The ``(len(spellings), hidden)`` float32 rows for the coord tokens, from ``weight``'s first ``stock_rows``
    rows (see the module contract)."""
    stock = weight[:stock_rows].float()
    if init == "mean":
        return stock.mean(0).expand(len(spellings), -1).clone()
    if init != "number":
        raise ValueError(f"init must be one of {INIT_METHODS}, got {init!r}")
    out = torch.empty(len(spellings), weight.shape[1], dtype=torch.float32)
    for k, ids in enumerate(spellings):
        if not ids or max(ids) >= stock_rows:
            raise ValueError(f"the spelling of {k} has ids outside the stock rows: {ids}")
        out[k] = place_weights(len(ids)) @ stock[ids]
    return out


@torch.no_grad()
def _init_rows(model, coord_ids: list[int], spellings: list[list[int]], stock_rows: int, new_rows: range,
               init: str) -> None:
    matrices = [model.get_input_embeddings().weight]
    if not is_tied(model):
        matrices.append(model.get_output_embeddings().weight)
    ids = torch.tensor(coord_ids)
    taken = set(coord_ids)
    rest = [i for i in new_rows if i not in taken]
    for w in matrices:
        w[ids] = coord_rows(w, spellings, stock_rows, init).to(w.dtype)
        if rest:
            w[torch.tensor(rest)] = w[:stock_rows].float().mean(0).to(w.dtype)


def _copy_aux_files(src: Path, dst: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in REWRITTEN and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, dst / f.name)


def _check_out(src: Path, out: Path, init: str) -> dict | None:
    """None: write ``out``. A dict: ``out`` already holds this preparation (its record). Refuses anything else."""
    if out.resolve() == src.resolve():
        raise PrepareRefused(f"--out {out} is the source directory; write the prepared checkpoint to a new directory")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    record = out / RECORD
    if record.is_file():
        done = json.loads(record.read_text(encoding="utf-8"))
        if done.get("source") == str(src.resolve()) and done.get("init") in (init, None):
            return done
    raise PrepareRefused(f"--out {out} exists and is not this preparation of {src}; choose a new directory or "
                         "remove it")


def _coord_state(tok) -> str:
    missing = missing_coord_bins(tok)
    if not missing:
        return "present"
    if len(missing) == len(all_coord_tokens()):
        return "absent"
    return f"partial ({len(all_coord_tokens()) - len(missing)} of {len(all_coord_tokens())})"


def prepare_checkpoint(source: str | Path, out: str | Path, init: str = "number",
                       pad_to_multiple_of: int = 1) -> PrepareResult:
    """Prepare ``source`` into ``out`` (see the module contract); ``PrepareRefused`` for what it cannot handle."""
    src, dst = Path(source), Path(out)
    if init not in INIT_METHODS:
        raise PrepareRefused(f"--init {init}: use one of {', '.join(INIT_METHODS)}")
    config = _load_config(src)
    if not _is_supported(config):
        raise PrepareRefused(f"--from {src}: unknown architecture model_type={config.model_type!r}; supported: "
                             f"{', '.join(sorted(VL_MODEL_TYPES))} and transformers' causal LMs")
    tok = _load_tokenizer(src)
    state = _coord_state(tok)
    if state.startswith("partial"):
        raise PrepareRefused(f"--from {src}: the tokenizer has {state} coord tokens; start from the stock checkpoint "
                             "(no coord tokens) or a fully prepared one")
    done = _check_out(src, dst, init)
    if done is not None:
        names = {f.name for f in fields(PrepareResult)}
        return PrepareResult(**{**{k: v for k, v in done.items() if k in names}, "out": str(dst), "written": False})
    text_rows = int(config.get_text_config().vocab_size)
    if state == "present":
        if text_rows < len(tok):
            raise PrepareRefused(f"--from {src}: the tokenizer has the coord tokens but the model only {text_rows} "
                                 f"embedding rows for {len(tok)} tokens; start from the stock checkpoint")
        result = PrepareResult(str(src.resolve()), str(dst), config.model_type, None, 0,
                               int(tok.convert_tokens_to_ids(all_coord_tokens()[0])), text_rows, text_rows,
                               bool(getattr(config, "tie_word_embeddings", False)), True, True)
        previous = (json.loads((src / RECORD).read_text(encoding="utf-8")) if (src / RECORD).is_file() else None)
        with _staged(dst) as tmp:
            shutil.copytree(src, tmp, dirs_exist_ok=True)
            _write_record(tmp, result, previous)
        return result
    model = _load_model(src, config)
    stock_tokens, stock_rows = len(tok), _rows(model)
    spellings = number_spellings(tok)
    tok.add_tokens(all_coord_tokens())
    coord_ids = list(tok.convert_tokens_to_ids(all_coord_tokens()))
    needed = max(stock_rows, len(tok))
    if pad_to_multiple_of > 1:
        needed = -(-needed // pad_to_multiple_of) * pad_to_multiple_of
    if needed != stock_rows:
        model.resize_token_embeddings(needed, mean_resizing=False)
    _init_rows(model, coord_ids, spellings, stock_tokens, range(stock_rows, needed), init)
    result = PrepareResult(str(src.resolve()), str(dst), config.model_type, init, len(coord_ids), coord_ids[0],
                           stock_rows, _rows(model), is_tied(model), False, True)
    with _staged(dst) as tmp:
        _copy_aux_files(src, tmp)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _write_record(tmp, result)
    return result


@contextlib.contextmanager
def _staged(dst: Path) -> Iterator[Path]:
    """A hidden sibling of ``dst`` to write into, renamed to ``dst`` when the block succeeds, removed when it fails."""
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        dst.rmdir()  # empty (checked by _check_out)
    os.replace(tmp, dst)


def _write_record(directory: Path, result: PrepareResult, previous: dict | None = None) -> None:
    """``prepare.json``: the result without its run-local fields; ``previous``: the source's own record, if any."""
    record = {k: v for k, v in asdict(result).items() if k not in ("out", "written")}
    record["tokens"] = "<|coord_0|>..<|coord_999|>"
    if previous is not None:
        record["previous"] = previous
    (directory / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
