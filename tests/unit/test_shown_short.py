"""What a notebook shows of an error or a stop inside one of nbrpc's calls, or inside a
local ``loss.backward()`` (which nbrpc routes): the cell's lines
(``nbrpc._errors.shown_short``), not nbrpc's frames."""

import os
import traceback

import pytest
import torch

import nbrpc
from nbrpc import _errors, autograd


def _sending():
    raise KeyboardInterrupt  # the stop button, landing while a call is being sent


def _failing():
    raise RuntimeError("torch's words")


@pytest.mark.parametrize(
    ("inside", "kind"), [(_sending, KeyboardInterrupt), (_failing, RuntimeError)]
)
def test_a_stop_or_an_error_inside_a_call_is_shown_short(inside, kind):
    with pytest.raises(kind) as raised:
        _errors.shown_short(inside)()
    assert type(raised.value) is kind  # the type stays: scripts and torch's tests see it
    shown = "".join(raised.value._render_traceback_())  # what IPython shows
    assert inside.__name__ in shown, shown  # the user's own frames stay
    assert "_errors.py" not in shown, shown  # nbrpc's do not


def _failing_with_a_cause():
    raise ValueError("the user's own") from KeyError("its cause")


class _RaisingInBackward(torch.autograd.Function):
    """A backward that calls ``raising``: the stop button landing there (torch's engine
    raises the KeyboardInterrupt), or the user's own error."""

    raising = staticmethod(_sending)

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _RaisingInBackward.raising()


def _backward_raising(raising, monkeypatch):
    """``loss.backward()`` through nbrpc's routed local backward, its backward raising."""
    monkeypatch.setattr(torch.autograd, "backward", torch.autograd.backward)
    monkeypatch.setattr(_RaisingInBackward, "raising", staticmethod(raising))
    autograd.install()
    loss = _RaisingInBackward.apply(torch.ones(2, requires_grad=True)).sum()
    loss.backward()


def test_a_stop_in_a_local_backward_shows_the_cells_lines_not_nbrpcs(monkeypatch):
    """nbrpc routes ``torch.autograd.backward`` (``loss.backward()`` on a graph that
    crossed workers says what to use instead): the stop button landing there shows the
    notebook's line, not nbrpc's frames, which torch's own backward does not have."""
    with pytest.raises(KeyboardInterrupt) as raised:
        _backward_raising(_sending, monkeypatch)
    libraries = (os.path.dirname(nbrpc.__file__), os.path.dirname(torch.__file__))
    passed = [f.filename for f in traceback.extract_tb(raised.value.__traceback__)]
    assert any(f.startswith(libraries[0]) for f in passed)  # it went through nbrpc's routing
    shown = "".join(raised.value._render_traceback_())
    assert "_backward_raising" in shown, shown  # the line of loss.backward()
    assert not any(lib in shown for lib in libraries), shown


def test_an_error_in_a_local_backward_keeps_torchs_whole_display(monkeypatch):
    """Only the stop shows short there: an error keeps IPython's own traceback, its
    chained cause included, as without nbrpc."""
    with pytest.raises(ValueError, match="the user's own") as raised:
        _backward_raising(_failing_with_a_cause, monkeypatch)
    assert isinstance(raised.value.__cause__, KeyError)
    assert getattr(raised.value, "_render_traceback_", None) is None


def _passes_on(error):
    raise error  # a worker's function that called another and got its error back


def test_a_cancelled_call_passed_back_through_a_nested_call_is_shown_once():
    """A call cancelled on worker2 that reached the kernel through worker1's function
    (a chain) showed its text three times, twice as ``nbrpc._errors.CallCancelledError``;
    a worker's own error keeps its remote traceback, named without nbrpc's modules."""
    from nbrpc._wire import failures

    first = failures.rebuild(failures.failure(nbrpc.CallCancelledError("worker2", "spin")))
    try:
        _passes_on(first)
    except nbrpc.CallCancelledError as exc:
        arrived = failures.rebuild(failures.failure(exc))
    shown = "\n".join(arrived._render_traceback_())
    assert shown.count("the call of spin on worker2 was cancelled") == 1, shown
    assert "nbrpc._" not in shown, shown

    try:
        _passes_on(nbrpc.SerializationError("a generator cannot be sent back"))
    except nbrpc.SerializationError as exc:
        own = failures.rebuild(failures.failure(exc))
    shown = "\n".join(own._render_traceback_())
    assert "Remote traceback" in shown, shown  # where it was raised still shows
    assert "in _passes_on" in shown, shown
    assert "\nSerializationError: a generator" in shown, shown
    assert "nbrpc._errors" not in shown, shown
