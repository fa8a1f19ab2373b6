"""Other libraries' APIs on attn's backends; today flash-attn 2's (:mod:`attn.compat.flash_attn`),
and :func:`install_flash_attn`, a ``flash_attn`` package in ``sys.modules`` for unmodified
flash-attn code (docs/flash-attn.md, "Unmodified flash-attn code").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["install_flash_attn", "uninstall_flash_attn"]

FLASH_ATTN_VERSION = "2.8.3"
_SHIM = "__attn_shim__"
_saved: dict[str, types.ModuleType | None] = {}  # what the shim replaced, for uninstall


class _ShimLoader(importlib.abc.Loader):
    """Loader of the shim modules: each is built from attn.compat's own modules (the default
    module object: Loader.create_module's None)."""

    def exec_module(self, module) -> None:
        module.__dict__.update(_contents(module.__name__))
        setattr(module, _SHIM, True)


def _public(mod) -> dict:
    return {n: getattr(mod, n) for n in mod.__all__}


def _contents(name: str) -> dict:
    from attn.compat import bert_padding, flash_attn, rotary
    if name in ("flash_attn", "flash_attn.flash_attn_interface"):
        d = _public(flash_attn)
        if name == "flash_attn":
            d["__version__"] = FLASH_ATTN_VERSION
        return d
    if name == "flash_attn.bert_padding":
        return _public(bert_padding)
    if name == "flash_attn.layers.rotary":
        return {n: getattr(rotary, n) for n in ("apply_rotary_emb", "apply_rotary_emb_func")}
    return {}  # flash_attn.layers: a namespace for rotary


_NAMES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding",
          "flash_attn.layers", "flash_attn.layers.rotary")
_PACKAGES = ("flash_attn", "flash_attn.layers")


def _make(name: str) -> types.ModuleType:
    spec = importlib.machinery.ModuleSpec(name, _ShimLoader(), origin="attn.compat",
                                          is_package=name in _PACKAGES)
    module = importlib.util.module_from_spec(spec)
    module.__doc__ = (f"flash-attn {FLASH_ATTN_VERSION}'s API served by attn (attn.compat); "
                      f"not the flash-attn package.")
    spec.loader.exec_module(module)
    return module


def _real_flash_attn_importable() -> bool:
    present = sys.modules.get("flash_attn")
    if present is not None:
        return not getattr(present, _SHIM, False)
    try:
        if importlib.util.find_spec("flash_attn") is None:
            return False
        importlib.import_module("flash_attn")
    except Exception:  # installed but broken here (no GPU build, missing CUDA libraries)
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            del sys.modules[name]
        return False
    return True


def install_flash_attn(force: bool = False) -> bool:
    """Register attn's flash-attn 2.8.3 API as the ``flash_attn`` package (its modules:
    ``_NAMES``). True when the shim is in place (also when it already was); False, doing
    nothing, when a real flash-attn is importable, unless ``force=True`` (replaced for this
    process; :func:`uninstall_flash_attn` puts it back)."""
    if getattr(sys.modules.get("flash_attn"), _SHIM, False):
        return True
    if not force and _real_flash_attn_importable():
        return False
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        _saved.setdefault(name, sys.modules.pop(name))
    modules = {name: _make(name) for name in _NAMES}
    for name, module in modules.items():
        _saved.setdefault(name, None)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return True


def uninstall_flash_attn() -> bool:
    """Remove the shim from ``sys.modules`` and restore what it replaced; False if it was
    not installed. Code that imported names from it keeps them."""
    if not getattr(sys.modules.get("flash_attn"), _SHIM, False):
        return False
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]
    for name, module in _saved.items():
        if module is not None:
            sys.modules[name] = module
    _saved.clear()
    return True
