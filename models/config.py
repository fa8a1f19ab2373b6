"""Typed configs for the toy GPT. Plain dataclasses of primitives, so a checkpoint can store
them as dicts and load them back with ``torch.load(weights_only=True)``.

The attention options are :class:`attn.nn.AttentionOptions`, declared there once; the
command-line flags of ``scripts/train.py`` are derived from the fields by :func:`add_flags`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from attn.nn import AttentionOptions, opt_field


@dataclass
class AttentionConfig(AttentionOptions):
    """The GPT's attention: every :class:`attn.nn.AttentionOptions` field, plus the layers
    the window applies to. ``causal`` must stay True (the GPT predicts the next token)."""

    causal: bool = opt_field(True, "bottom-right causal mask; must stay on (the GPT predicts "
                             "the next token)")
    # Local layers interleaved with global ones as in Gemma 2/3 and gpt-oss; a window of 1
    # on layer 0 hands each position its predecessor.
    window_layers: list[int] | None = opt_field(
        None, "layers that use the window (none = all)")


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 128  # training context length
    n_layer: int = 4
    dim: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0  # residual and embedding dropout (attention's is attention.dropout)
    bias: bool = False  # LayerNorm and MLP biases (attention's projections: attention.bias)
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):  # coming back from a checkpoint
            d = dict(self.attention)
            # saved before attention had its own bias: the GPT's applied to every projection
            d.setdefault("bias", self.bias)
            self.attention = AttentionConfig(**d)
        a = self.attention
        if self.dim % a.heads != 0:
            raise ValueError(f"attention.heads must divide dim, got dim={self.dim}, "
                             f"heads={a.heads}")
        if not a.causal:
            raise ValueError("attention.causal must be True: the GPT predicts the next token")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        return cls(**d)


# -- command-line flags from dataclass fields --------------------------------------------------

def _none_or(convert):
    def parse(s: str):
        return None if s.lower() == "none" else convert(s)
    return parse


def _checked(convert, choices, name: str):
    def parse(s: str):
        value = convert(s)
        if choices is not None and value is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"{name} must be one of {tuple(choices)}, got {s!r}")
        return value
    return parse


def _with_message(convert, name: str):
    def parse(s: str):
        try:
            return convert(s)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"--{name}: {exc}") from None
    parse.__name__ = name  # argparse names the converter in its "invalid value" message
    return parse


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
              required: tuple[str, ...] = (),
              parse: dict[str, Callable[[str], Any]] | None = None,
              helps: dict[str, str] | None = None) -> None:
    """One ``--flag`` per field of the dataclass ``cls`` (``qk_norm`` → ``--qk-norm``).

    The type decides the flag: bool → ``--x`` / ``--no-x``; int, float, str → a value
    (``none`` for fields that may be None); ``list[int]`` → one or more values; other types
    need a ``parse`` entry in the field's metadata (see :func:`attn.nn.opt_field`), which also
    supplies ``help`` and ``choices``; ``parse`` here overrides it per field, for a command
    line that accepts more spellings than the field, and ``helps`` then says how. Nested
    dataclasses and ``skip`` get no flag. Defaults stay the dataclass's own: a flag not given
    is absent from the parsed namespace; a ``required`` flag shows no default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        typ = hints[f.name]
        args = typing.get_args(typ)
        optional = (typing.get_origin(typ) in (typing.Union, types.UnionType)
                    and type(None) in args)
        base = [a for a in args if a is not type(None)] if optional else [typ]
        base = base[0] if len(base) == 1 else typ
        if dataclasses.is_dataclass(base):
            continue
        flag = "--" + f.name.replace("_", "-")
        help = "; ".join(filter(None, (f.metadata.get("help"), (helps or {}).get(f.name))))
        if f.name in required:
            help = f"{help} (required)"
        elif f.default is not dataclasses.MISSING and base is not bool:
            shown = "none" if f.default is None else f.default
            help = f"{help} (default: {shown})" if help else f"default: {shown}"
        kw: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=help)
        if f.name in required:
            kw["required"] = True
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if typing.get_origin(base) is list and typing.get_args(base) in ((int,), (float,),
                                                                         (str,)):
            convert, kw["nargs"] = typing.get_args(base)[0], "+"
        elif parse and f.name in parse:
            convert = parse[f.name]
        elif "parse" in f.metadata:
            convert = f.metadata["parse"]
        elif base in (int, float, str):
            convert = base
        else:
            raise TypeError(f"field {cls.__name__}.{f.name} has type {typ}, which has no "
                            "flag spelling: give it metadata parse=<str -> value>")
        choices = f.metadata.get("choices")
        if choices is not None:
            shown = [*map(str, choices), *(["none"] if optional else [])]
            kw["metavar"] = "{" + ",".join(shown) + "}"
        convert = _checked(_none_or(convert) if optional else convert, choices, f.name)
        parser.add_argument(flag, type=_with_message(convert, f.name), **kw)


def flag_values(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` given on the command line, ready for ``cls(**values)``."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(namespace).items() if k in names}
