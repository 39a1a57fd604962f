"""What a notebook shows of an error or a stop inside one of nbrpc's calls: the cell's
lines (``nbrpc._wire.failures.shown_short``), not nbrpc's frames."""

import pytest

from nbrpc._wire import failures


def _sending():
    raise KeyboardInterrupt  # the stop button, landing while a call is being sent


def _failing():
    raise RuntimeError("torch's words")


@pytest.mark.parametrize(
    ("inside", "kind"), [(_sending, KeyboardInterrupt), (_failing, RuntimeError)]
)
def test_a_stop_or_an_error_inside_a_call_is_shown_short(inside, kind):
    with pytest.raises(kind) as raised:
        failures.shown_short(inside)()
    assert type(raised.value) is kind  # the type stays: scripts and torch's tests see it
    shown = "".join(raised.value._render_traceback_())  # what IPython shows
    assert inside.__name__ in shown, shown  # the user's own frames stay
    assert "failures.py" not in shown, shown  # nbrpc's do not
