"""The page's input components, as Gradio's, but a value one of them refuses costs one line in the log.

Gradio checks a value sent for an input (a slider past its maximum, a choice not in a dropdown, a file of another
type) in the component's ``preprocess`` and raises ``gr.Error``; its queue then prints the whole traceback to
stderr, once per request, with no limit and around any logging filter: 40 out-of-range values in 5 s were 40
tracebacks. These subclasses (Gradio's documented way to change what a component does with a value: override
``preprocess``) turn that refusal into one warning through ``logging``, the same words for every value sent to one
input (where :class:`app.guard.log_limits.LogLimits` rate-limits it), and the same ``gr.Error``, its message capped,
raised with ``print_exception=False``: the browser sees what it saw before. Each keeps Gradio's class name, which
picks the component the browser draws. (Gradio writes ``inputs.pyi``, its typing stub of their events, beside this
file when they are defined; git ignores it.)
"""

from __future__ import annotations

import logging
from typing import Any

import gradio as gr

from moco.errors import clipped, quoted

__all__ = ["Slider", "Number", "Dropdown", "Radio", "CheckboxGroup", "File", "Gallery", "MAX_MESSAGE"]

logger = logging.getLogger(__name__)

MAX_MESSAGE = 200  # characters of a refusal's message: a dropdown's lists every choice, and echoes the value sent


class _Refusing:
    """``preprocess`` as the component's own, a refusal logged as one line and raised without a traceback."""

    label: str | None

    def preprocess(self, payload: Any) -> Any:
        try:
            return super().preprocess(payload)  # type: ignore[misc]
        except gr.Error as e:
            message = str(e.message)
            for form in {repr(payload), str(payload)}:  # the value sent, as the message quotes it: shortened
                if len(form) > 40:
                    message = message.replace(form, quoted(payload, 40))
            message = clipped(message, MAX_MESSAGE)
            name = self.label or type(self).__name__
            logger.warning("a page event's input %r refused a value sent to it (the client is told why)", name)
            logger.debug("the input %r refused: %s", name, message)  # the value varies: one line per input above
            raise gr.Error(message, title=e.title, print_exception=False) from None


class Slider(_Refusing, gr.Slider):
    """``gr.Slider``: a value past its bounds refused in one log line."""


class Number(_Refusing, gr.Number):
    """``gr.Number``: a value past its bounds refused in one log line."""


class Dropdown(_Refusing, gr.Dropdown):
    """``gr.Dropdown``: a value not among its choices refused in one log line."""


class Radio(_Refusing, gr.Radio):
    """``gr.Radio``: a value not among its choices refused in one log line."""


class CheckboxGroup(_Refusing, gr.CheckboxGroup):
    """``gr.CheckboxGroup`` of results to tick: a value no longer among its choices is dropped, not refused. The page's
    ticks list the results shown; a tick sent after a search changed them (the browser's event still on its way under
    load) names a result that is gone, which the search it feeds would leave out anyway."""

    def preprocess(self, payload: Any) -> Any:
        if isinstance(payload, list):  # anything else is Gradio's to refuse
            shown = {value for _, value in self.choices}
            payload = [v for v in payload if isinstance(v, int | float | str) and v in shown]  # nothing new let in
        return super().preprocess(payload)


class File(_Refusing, gr.File):
    """``gr.File``: a file of a type it does not take refused in one log line."""


class Gallery(_Refusing, gr.Gallery):
    """``gr.Gallery``: a file of a type it does not take refused in one log line."""
