"""Each engine source's own options: one module per source, one class each, and one
registration line here (:func:`nbrpc._placement.register`, whose base
:class:`~nbrpc._placement.SourceOptions` and registry sit below them).

* :mod:`.ssh` -- :class:`Hosts` (``--hosts``, ``--ssh-args``);
* :mod:`.attached` -- :class:`Attached` (``--profile``, ``--cluster-id``);
* :mod:`.slurm` -- :class:`Slurm` (``--slurm`` and its flags), exported as ``nbrpc.Slurm``.

The options layer holds them, below the engine sources (:mod:`nbrpc._engines`) that read
them with ``settings.options_of(cls)``. The order of the registrations is the order in
which two sources' checks speak when both are asked for, and in which ``--remote-python``
names the sources it goes with.
"""

from __future__ import annotations

from nbrpc._placement import register

from .attached import Attached
from .slurm import Slurm
from .ssh import Hosts

register(Hosts)
register(Attached)
register(Slurm)
