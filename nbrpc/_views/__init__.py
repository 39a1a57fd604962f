"""The views: plain data in, HTML/SVG/text out, one module per view.

Each view is computed from the lists and dicts that a lower layer returns
(``nbrpc.status()``, ``nbrpc.ownership()``, ``nbrpc.trace_backward()``, ``nbrpc.record()``,
``nbrpc.stacks()``), as pure functions: testable without a browser, usable without widgets
(``_repr_html_`` in nbconvert, text in a terminal). The SVG carries ``data-*`` attributes
(worker names, RRef ids, edge kinds, call ids) that the widgets' front end
(``nbrpc/static/views.js``) uses for hover highlighting and the browser test reads.

* :mod:`.draw` -- what they all draw with (font, bytes, columns, a widget's text fallback),
  and how a display no longer live is retired;
* :mod:`.cluster` -- a card per process, the headline, ``%rpc_init``'s summary;
* :mod:`.ownership` -- RRefs in their owners, edges to holders;
* :mod:`.backward` -- a backward pass, lane by lane;
* :mod:`.timeline` -- a recording's calls on one clock;
* :mod:`.stacks` -- every thread's stack;
* :mod:`.panel` -- the cluster panel: the card, the ownership view, the last timeline,
  the actions.

Adding a view is docs/architecture.md's recipe ("Adding a view").
"""

from .backward import (  # noqa: F401 (re-exported: _views.NAME)
    backward_svg,
    backward_text,
)
from .cluster import (  # noqa: F401 (re-exported: _views.NAME)
    cluster_html,
    cluster_text,
    cuda_text,
    headline,
    records_text,
    resources_text,
    summary_text,
)
from .draw import (  # noqa: F401 (re-exported: _views.NAME)
    FONT,
    Retiring,
    bytes_text,
    close_widget,
    columns,
    retire,
    widget_bundle,
)
from .ownership import (  # noqa: F401 (re-exported: _views.NAME)
    MAX_RREFS_PER_OWNER,
    ownership_svg,
    ownership_text,
)
from .panel import (  # noqa: F401 (re-exported: _views.NAME)
    panel_html,
    panel_text,
)
from .stacks import (  # noqa: F401 (re-exported: _views.NAME)
    stacks_text,
)
from .timeline import (  # noqa: F401 (re-exported: _views.NAME)
    timeline_html,
    timeline_svg,
    timeline_text,
)
