"""Someone else's attention function (named by :func:`load_target`), called in attn's
convention (:class:`Adapted`) for ``attn check`` and ``attn bench --fn``. :func:`adapt`
translates for the calling styles :data:`STYLES` (docs/conformance.md, "Calling styles"); a
keyword a style cannot express raises ``NotImplementedError`` naming it, so a conformance
matrix reads "not supported" rather than a wrong answer.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from attn.masks import dense_keep

STYLES = ("attn", "torch", "flash", "hf")
LAYOUTS = ("bhnd", "bnhd")
# the layout of q, k, v (and out) each style takes when none is given
_STYLE_LAYOUT = {"attn": "bhnd", "torch": "bhnd", "flash": "bnhd", "hf": "bhnd"}

# attn.attention's keywords and their defaults: a keyword left at its default is not passed
_DEFAULTS = {"causal": False, "attn_mask": None, "scale": None, "temperature": 1.0,
             "softcap": None, "window": None, "sinks": None, "dropout_p": 0.0,
             "return_lse": False, "alibi_slopes": None, "score_mod": None, "mask_mod": None}


def load_target(spec: str) -> Callable:
    """The callable named by ``spec``: ``"pkg.mod:fn"`` (imported) or ``"path/to/file.py:fn"``
    (loaded from that file); ``fn`` may be dotted (``"pkg.mod:Class.method"``).

    Raises ValueError naming ``spec`` when it has no ``:``, the module or file cannot be
    loaded, the name is missing, or what it names is not callable.
    """
    where, _, attr = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not where or not attr:  # no ":" leaves where empty
        raise ValueError(f"target {spec!r} must be 'module:function' or 'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"target {spec!r}: no file {str(path)!r}")
        name = f"_attn_target_{path.stem}_{abs(hash(str(path.resolve())))}"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up here
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise ValueError(f"target {spec!r}: loading {str(path)!r} raised "
                             f"{type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ValueError(f"target {spec!r}: importing {where!r} raised "
                             f"{type(e).__name__}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            have = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise ValueError(f"target {spec!r}: {where!r} has no {part!r}"
                             + (f" (it has {', '.join(have[:12])}{' ...' if len(have) > 12 else ''})"
                                if have else ""))
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"target {spec!r} names a {type(obj).__name__}, not a function")
    return obj


def params_of(fn: Callable) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature
        return None


def takes(params: dict[str, inspect.Parameter] | None, name: str) -> bool:
    """Whether a function of signature ``params`` (:func:`params_of`; None, unreadable, is
    assumed to) takes the keyword ``name``, by name or through ``**kwargs``."""
    return params is None or name in params or any(
        p.kind is p.VAR_KEYWORD for p in params.values())


def detect_style(fn: Callable) -> tuple[str, str]:
    """The calling style of ``fn`` guessed from its signature, and a sentence saying why."""
    if fn is torch.nn.functional.scaled_dot_product_attention:
        return "torch", "torch, because it is torch.nn.functional.scaled_dot_product_attention"
    params = params_of(fn)
    if params is None:
        return "attn", ("attn, by default: its signature cannot be read (give --style if it "
                        "is torch-, flash- or hf-style)")
    names = list(params)
    styles = (("flash", ("softmax_scale", "window_size", "return_attn_probs")),
              ("torch", ("is_causal", "enable_gqa")),
              ("attn", ("causal", "return_lse", "window", "sinks", "softcap")))
    if names[:1] == ["module"] and "attention_mask" in params:  # HF's interface signature
        styles = (("hf", ("module", "attention_mask", "scaling")),)
    for style, marks in styles:
        found = [m for m in marks if m in params]
        if found:
            return style, (f"{style}, from its signature (parameters "
                           f"{', '.join(repr(f) for f in found)})")
    return "attn", ("attn, by default: its signature "
                    f"({', '.join(names)}) names none of the other styles' keywords")


class _HFModule(torch.nn.Module):
    """What a transformers attention interface reads from its ``module`` argument."""

    def __init__(self, groups: int, head_dim: int, scaling: float, training: bool):
        super().__init__()
        self.num_key_value_groups = groups
        self.head_dim = head_dim
        self.scaling = scaling
        self.is_causal = False  # causality arrives in the mask
        self.layer_idx = 0
        self.train(training)


class Adapted:
    """``fn`` called in attn's convention: ``adapted(q, k, v, *, causal=..., ...)`` with q
    (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) → out (B, H, Nq, Dv), or
    ``(out, lse)`` with ``return_lse=True`` (lse (B, H, Nq), natural log, -inf on empty
    rows). ``.name``, ``.style``, ``.layout`` and ``.detected`` (how the style was decided)
    describe it; a keyword the style cannot express raises NotImplementedError."""

    def __init__(self, fn: Callable, style: str, layout: str, name: str, detected: str):
        self.fn, self.style, self.layout, self.name, self.detected = (
            fn, style, layout, name, detected)
        self._params = params_of(fn)

    def __repr__(self) -> str:
        return f"Adapted({self.name!r}, style={self.style!r}, layout={self.layout!r})"

    # -- helpers ----------------------------------------------------------------------------

    def _refuse(self, what: str, why: str = "") -> NotImplementedError:
        return NotImplementedError(f"{self.name} ({self.style} style) cannot express {what}"
                                   + (f": {why}" if why else ""))

    def _flip(self, t: Tensor) -> Tensor:
        """(B, H, N, D) <-> fn's layout, both ways (bnhd is a transpose of bhnd)."""
        return t.transpose(1, 2) if self.layout == "bnhd" else t

    def _only(self, kw: dict, allowed: tuple[str, ...], why: dict[str, str] | None = None) -> None:
        """Refuse every keyword set to a non-default value that ``allowed`` leaves out."""
        for name, value in kw.items():
            if name not in allowed and not _is_default(name, value):
                raise self._refuse(f"{name}={_show(value)}", (why or {}).get(name, ""))

    def _folded_scale(self, q: Tensor, scale, temperature) -> float | None:
        """attn's scale / temperature as one float (styles without a temperature)."""
        if isinstance(temperature, Tensor):
            raise self._refuse("a tensor temperature", "it has no temperature; a float "
                               "temperature is folded into the scale")
        if temperature == 1.0:
            return scale
        return (q.shape[-1] ** -0.5 if scale is None else scale) / temperature

    # -- the call ---------------------------------------------------------------------------

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                 attn_mask: Tensor | None = None, scale: float | None = None,
                 temperature: float | Tensor = 1.0, softcap: float | Tensor | None = None,
                 window: tuple[int, int] | None = None, sinks: Tensor | None = None,
                 dropout_p: float = 0.0, return_lse: bool = False,
                 alibi_slopes: Tensor | None = None, score_mod=None, mask_mod=None):
        kw = dict(causal=causal, attn_mask=attn_mask, scale=scale, temperature=temperature,
                  softcap=softcap, window=window, sinks=sinks, dropout_p=dropout_p,
                  return_lse=return_lse, alibi_slopes=alibi_slopes, score_mod=score_mod,
                  mask_mod=mask_mod)
        return getattr(self, f"_call_{self.style}")(q, k, v, **kw)

    def _call(self, q, k, v, args: dict):
        """``fn`` on q, k, v in its layout with ``args``, each refused first where its
        signature has no such parameter."""
        for name, value in args.items():
            if not takes(self._params, name):
                raise self._refuse(f"{name}={_show(value)}", "its signature has no such "
                                   "parameter")
        return self.fn(self._flip(q), self._flip(k), self._flip(v), **args)

    def _out_lse(self, res, q: Tensor, asked: str, shape: str) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` from what ``fn`` returned when ``asked`` for its lse, lse (B, H, Nq)
        in attn's convention; (B, Nq, H) is accepted in bnhd layout."""
        if not (isinstance(res, (tuple, list)) and len(res) >= 2):
            raise self._refuse("return_lse=True", f"called with {asked}, it returned "
                               f"{type(res).__name__}, not {shape}")
        out, lse, (B, H, Nq) = self._flip(res[0]), res[1], q.shape[:3]
        if self.layout == "bnhd" and tuple(lse.shape) == (B, Nq, H) and (Nq != H):
            lse = lse.transpose(1, 2)
        return out, lse

    def _call_attn(self, q, k, v, **kw):
        res = self._call(q, k, v, {n: val for n, val in kw.items() if not _is_default(n, val)})
        if not kw["return_lse"]:
            return self._flip(_first(res))
        return self._out_lse(res, q, "it", "(out, lse)")

    def _call_torch(self, q, k, v, **kw):
        self._only(kw, ("causal", "attn_mask", "scale", "temperature", "dropout_p"), {
            "return_lse": "SDPA returns the output only"})
        n_q, n_k = q.shape[2], k.shape[2]
        if kw["causal"] and n_q != n_k:
            raise self._refuse(f"causal with Nq={n_q} != Nk={n_k}", "torch's is_causal aligns "
                               "the top-left corner, attn's causal the bottom-right")
        args = {}
        mask = kw["attn_mask"]
        if kw["causal"] and mask is not None:  # SDPA refuses is_causal beside a mask: fold it
            tril = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
            mask = (mask & tril if mask.dtype == torch.bool
                    else mask.masked_fill(~tril, float("-inf")))
        elif kw["causal"]:
            args["is_causal"] = True
        if mask is not None:
            args["attn_mask"] = mask
        if kw["dropout_p"]:
            args["dropout_p"] = kw["dropout_p"]
        scale = self._folded_scale(q, kw["scale"], kw["temperature"])
        if scale is not None:
            if not takes(self._params, "scale"):
                raise self._refuse(f"scale={scale}", "its signature has no 'scale'")
            args["scale"] = scale
        if q.shape[1] != k.shape[1]:
            if not takes(self._params, "enable_gqa"):
                raise self._refuse(f"GQA (H={q.shape[1]}, Hkv={k.shape[1]})", "its signature "
                                   "has no 'enable_gqa'")
            args["enable_gqa"] = True
        out = self.fn(self._flip(q), self._flip(k), self._flip(v), **args)
        return self._flip(_first(out))

    def _call_flash(self, q, k, v, **kw):
        self._only(kw, ("causal", "scale", "temperature", "softcap", "window", "dropout_p",
                        "return_lse"), {"attn_mask": "flash-attn takes no mask",
                                        "sinks": "flash-attn has no sinks"})
        if isinstance(kw["softcap"], Tensor):
            raise self._refuse("a tensor softcap", "flash-attn's softcap is a float")
        # flash-attn's keyword for each attn keyword set (None: left out)
        args = {"causal": True if kw["causal"] else None,
                "window_size": None if kw["window"] is None else tuple(kw["window"]),
                "softcap": None if kw["softcap"] is None else float(kw["softcap"]),
                "dropout_p": kw["dropout_p"] or None,
                "softmax_scale": self._folded_scale(q, kw["scale"], kw["temperature"]),
                "return_attn_probs": True if kw["return_lse"] else None}
        res = self._call(q, k, v, {n: val for n, val in args.items() if val is not None})
        if not kw["return_lse"]:
            return self._flip(_first(res))
        out, lse = self._out_lse(res, q, "return_attn_probs=True", "(out, lse, ...)")
        # flash-attn marks a row with no key by lse = +inf; attn by -inf
        return out, torch.where(lse == float("inf"), float("-inf"), lse)

    def _call_hf(self, q, k, v, **kw):
        self._only(kw, ("causal", "attn_mask", "scale", "temperature", "window", "dropout_p",
                        "softcap"), {"return_lse": "an HF interface returns the attention "
                                     "weights, not an lse"})
        if kw["softcap"] is not None and not (self._params is None or "softcap" in self._params):
            raise self._refuse(f"softcap={_show(kw['softcap'])}", "its signature names no "
                               "'softcap' (HF interfaces drop unknown keywords silently)")
        keep = dense_keep(q.shape[-2], k.shape[-2], causal=kw["causal"],
                          window=None if kw["window"] is None else tuple(kw["window"]),
                          attn_mask=kw["attn_mask"], device=q.device)
        mask = None
        if keep is not None:  # HF's eager path adds the mask to the scores: make it additive
            mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~keep, float("-inf"))
        if kw["attn_mask"] is not None and kw["attn_mask"].dtype != torch.bool:
            mask = kw["attn_mask"] if mask is None else mask + kw["attn_mask"]
        if mask is not None:
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        scale = self._folded_scale(q, kw["scale"], kw["temperature"])
        scaling = q.shape[-1] ** -0.5 if scale is None else scale
        module = _HFModule(q.shape[1] // k.shape[1], q.shape[-1], scaling,
                           training=kw["dropout_p"] > 0)
        args = {"scaling": scaling, "dropout": kw["dropout_p"]}
        if kw["softcap"] is not None:
            args["softcap"] = kw["softcap"]
        # HF interfaces return (B, N, H, D)
        return _first(self.fn(module, q, k, v, mask, **args)).transpose(1, 2)


def _first(res):
    return res[0] if isinstance(res, (tuple, list)) else res


def _is_default(name: str, value) -> bool:
    default = _DEFAULTS[name]
    if default is None:
        return value is None
    return not isinstance(value, Tensor) and value == default


def _show(value) -> str:
    return f"tensor{tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)


def adapt(fn: Callable, *, style: str = "auto", layout: str | None = None,
          name: str | None = None) -> Adapted:
    """``fn`` as a callable in attn's convention (see the module docstring).

    ``style``: ``"auto"`` (guessed from the signature; ``.detected`` says from what), or one
    of :data:`STYLES`. ``layout``: the layout ``fn`` takes q, k, v and returns out in,
    ``"bhnd"`` or ``"bnhd"``; None means the style's own (``bnhd`` for flash, ``bhnd``
    otherwise; an hf interface always takes (B, H, N, D) and returns (B, N, H, D)).
    ``name`` defaults to the function's qualified name.
    """
    if isinstance(fn, Adapted):
        return fn
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if style == "auto":
        style, detected = detect_style(fn)
    elif style in STYLES:
        detected = f"{style}, as given"
    else:
        raise ValueError(f"style must be 'auto' or one of {STYLES}, got {style!r}")
    if layout is None:
        layout = _STYLE_LAYOUT[style]
    elif layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    elif style == "hf" and layout != "bhnd":
        raise ValueError("layout: an hf attention interface takes (B, H, N, D) and returns "
                         f"(B, N, H, D) by definition; got layout={layout!r}")
    if name is None:
        name = (getattr(fn, "__module__", None) or "") + ":" + getattr(
            fn, "__qualname__", type(fn).__name__)
        name = name.lstrip(":")
    return Adapted(fn, style, layout, name, detected)
