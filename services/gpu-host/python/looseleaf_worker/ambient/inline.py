"""Figures of a session that drew with matplotlib's inline backend render as
images in a later worker, without importing pyplot until one is shown."""

from __future__ import annotations

import sys


def _inline_figures(shell) -> None:
    """The session drew with the inline backend: a Figure shown as a cell's value
    renders as an image, as in the kernel, without importing pyplot until one is
    shown. The first Figure formatted sets the inline support up for real."""
    inline = sys.modules.get("matplotlib_inline.backend_inline")
    if inline is not None and getattr(inline.configure_inline_support, "current_backend", None) == "inline":
        return  # this worker drew already: the formatters are the real ones
    key = ("matplotlib.figure", "Figure")
    formatters = shell.display_formatter.formatters
    hooks = []

    def hook_for(mime):
        def first_figure(fig):
            # IPython moved the hook that was asked from the deferred printers to
            # the type printers: take every one of ours out, then set up the real ones
            for f in formatters.values():
                if f.deferred_printers.get(key) in hooks:
                    f.deferred_printers.pop(key, None)
                if f.type_printers.get(type(fig)) in hooks:
                    f.type_printers.pop(type(fig), None)
            from IPython.core.pylabtools import select_figure_formats
            from matplotlib_inline.backend_inline import InlineBackend, configure_inline_support

            configure_inline_support(shell, "inline")
            cfg = InlineBackend.instance(parent=shell)
            select_figure_formats(shell, cfg.figure_formats, **cfg.print_figure_kwargs)
            printer = formatters[mime].type_printers.get(type(fig))
            return printer(fig) if printer is not None and printer not in hooks else None

        return first_figure

    for mime in ("image/png", "image/svg+xml", "image/jpeg", "application/pdf"):
        f = formatters.get(mime)
        if f is None or key in f.deferred_printers or any(t.__name__ == "Figure" for t in f.type_printers):
            continue
        hooks.append(hook_for(mime))
        f.for_type_by_name(*key, hooks[-1])
