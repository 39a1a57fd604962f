"""The documentation site's generated sources (tools/docs_site.py) and the plugin that keeps
the tutorials' outputs (tests/notebook_outputs.py), without Sphinx, a browser or a kernel.

The whole site is built by ``make docs`` and opened in Chromium by tests/test_docs_site.py;
these check what each piece writes from the code: a page per public name, a magic's page
from its parser, a tutorial's note when its run did not go through.
"""

from __future__ import annotations

from types import SimpleNamespace

import nbformat
import pytest
from conftest import load_tool
from notebook_outputs import RUN_KEY, NotebookOutputs

import nbrpc

docs_site = load_tool("docs_site")


def test_guides_link_to_the_tutorials_on_the_site_and_name_other_files():
    text = (
        "See [tutorial 06](../notebooks/06_seeing_the_cluster.ipynb#the-views), "
        "[tests/test_debugger.py](../tests/test_debugger.py) and "
        "[the code](../nbrpc/_debugger/)."
    )
    assert docs_site.guide_text(text) == (
        "See [tutorial 06](notebooks/06_seeing_the_cluster.ipynb#the-views), "
        "`tests/test_debugger.py` and the code (`nbrpc/_debugger/`)."
    )


def test_every_public_name_has_an_api_page_with_its_directive():
    names = docs_site.public_names("nbrpc")
    assert set(names) == set(nbrpc.__all__) - {"__version__", "autograd", "optim", "widgets"}
    assert ".. autofunction:: nbrpc.init" in docs_site.api_page("nbrpc.init")
    assert ".. autoclass:: nbrpc.Cluster\n   :members:" in docs_site.api_page("nbrpc.Cluster")
    assert ".. autoexception:: nbrpc.BootError" in docs_site.api_page("nbrpc.BootError")
    assert "torch's ``torch.distributed.rpc.RRef``" in docs_site.api_page("nbrpc.RRef")
    index = docs_site.api_index()
    for name in names:
        assert f"(nbrpc.{name}.rst)" in index, name


def test_a_sub_package_page_links_a_name_it_shares_with_nbrpc_instead_of_repeating_it():
    page = docs_site.subpackage_page("nbrpc.autograd")
    assert "The same object as :func:`nbrpc.trace_backward`" in page
    assert ".. autofunction:: nbrpc.autograd.backward" in page


def test_a_rows_page_lists_every_key_with_its_comment():
    table = docs_site.typeddict_keys(nbrpc.StatusRow)
    for key in nbrpc.StatusRow.__annotations__:
        assert f"``{key}``" in table, key
    assert "resident memory, bytes" in table  # memory_rss's comment
    assert "% of one core since the previous status" in table  # a #: line above its key


@pytest.mark.parametrize(("name", "kind", "method"), docs_site.magics())
def test_a_magics_page_has_every_argument_its_parser_declares(name, kind, method):
    page = docs_site.magic_page(name, kind, method)
    assert page.startswith(f"# `{'%' if kind == 'line' else '%%'}{name}`")
    parser = getattr(method, "parser", None)
    if parser is None:
        assert "It takes no arguments." in page
        return
    for action in parser._actions:
        if action.dest == "help":
            continue
        for flag in action.option_strings or [action.metavar or action.dest]:
            assert f"`{flag}" in page, (name, flag)


def test_rpc_init_s_page_carries_each_options_documentation_from_options_py():
    from nbrpc import _options
    from nbrpc._magics import RpcMagics

    page = docs_site.magic_page("rpc_init", "line", RpcMagics.rpc_init)
    for option in _options.declared().values():
        if option.flag is not None and option.doc:
            assert docs_site._md_cell(option.doc) in page, option.flag


def _notebook(tmp_path, name: str, run: dict | None):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"), nbformat.v4.new_code_cell("1 + 1")]
    if run is not None:
        nb.metadata[RUN_KEY] = run
    nbformat.write(nb, tmp_path / name)
    return tmp_path / name


def test_a_tutorial_that_did_not_run_shows_why_under_its_title(tmp_path, monkeypatch):
    monkeypatch.setattr(docs_site, "EXECUTED", tmp_path)
    _notebook(tmp_path, "09_x.ipynb", {"skipped": "09_x.ipynb: fake hosts need root"})
    _notebook(tmp_path, "01_x.ipynb", {})
    skipped = docs_site.site_notebook(tmp_path / "09_x.ipynb")
    assert skipped.cells[1].cell_type == "markdown"
    assert "without its outputs: 09_x.ipynb: fake hosts need root" in skipped.cells[1].source
    assert len(docs_site.site_notebook(tmp_path / "01_x.ipynb").cells) == 2  # no note
    never = tmp_path / "never" / "02_x.ipynb"
    never.parent.mkdir()
    _notebook(never.parent, "02_x.ipynb", None)
    assert "has not been run here" in docs_site.site_notebook(never).cells[1].source


def test_stale_notebooks_are_those_whose_code_changed(tmp_path, monkeypatch):
    sources, executed = tmp_path / "notebooks", tmp_path / "executed"
    sources.mkdir()
    executed.mkdir()
    monkeypatch.setattr(docs_site, "NOTEBOOKS", sources)
    monkeypatch.setattr(docs_site, "EXECUTED", executed)
    same, edited, missing = (_notebook(sources, n, None) for n in ("a.ipynb", "b.ipynb", "c.ipynb"))
    _notebook(executed, "a.ipynb", {})
    nb = nbformat.read(_notebook(executed, "b.ipynb", {}), 4)
    nb.cells[1].source = "1 + 2"
    nbformat.write(nb, executed / "b.ipynb")
    assert docs_site.stale_notebooks() == [edited, missing]
    assert same not in docs_site.stale_notebooks()


class IPyNbCell:  # nbval's item class, as the plugin recognises it (by name)
    def __init__(self, parent, number: int, outputs) -> None:
        self.parent, self.cell_num, self.test_outputs = parent, number, outputs


def _report(when: str, outcome: str, reason: str = ""):
    longrepr = ("x.ipynb", 0, f"Skipped: {reason}") if outcome == "skipped" else None
    report = SimpleNamespace(
        skipped=outcome == "skipped", failed=outcome == "failed", longrepr=longrepr
    )
    return SimpleNamespace(when=when), SimpleNamespace(get_result=lambda: report)


def _run(plugin: NotebookOutputs, items, outcomes) -> None:
    plugin.pytest_collection_finish(SimpleNamespace(items=items))
    for item, outcome in zip(items, outcomes, strict=True):
        for when in ("setup", "call", "teardown"):
            call, result = _report(when, outcome if when != "teardown" else "passed", "why")
            hook = plugin.pytest_runtest_makereport(item, call)
            next(hook)
            with pytest.raises(StopIteration):
                hook.send(result)


class IPyNbFile:  # nbval's notebook node: the notebook it read, and its path
    def __init__(self, tmp_path, cells: int) -> None:
        self.nb = nbformat.v4.new_notebook()
        self.nb.cells = [nbformat.v4.new_code_cell(f"{i}") for i in range(cells)]
        self.fspath = tmp_path / "t.ipynb"


def test_the_plugin_writes_a_tutorial_with_its_outputs_and_how_it_went(tmp_path):
    out = tmp_path / "out"
    parent = IPyNbFile(tmp_path, 2)
    stream = nbformat.v4.new_output("stream", name="stdout", text="hi\n")
    result = {"output_type": "execute_result", "data": {"text/plain": "2"}, "metadata": {}}
    items = [IPyNbCell(parent, 0, [stream]), IPyNbCell(parent, 1, [result])]
    _run(NotebookOutputs(out), items, ["passed", "failed"])
    nb = nbformat.read(out / "t.ipynb", 4)
    assert nb.cells[0].outputs[0].text == "hi\n"
    assert nb.cells[1].outputs[0].data["text/plain"] == "2"
    assert nb.cells[1].execution_count == nb.cells[1].outputs[0].execution_count == 2
    assert nb.metadata[RUN_KEY] == {"failed": 2}


def test_the_plugin_says_why_a_tutorial_was_skipped_and_skips_a_partial_run(tmp_path):
    out = tmp_path / "out"
    parent = IPyNbFile(tmp_path, 2)
    items = [IPyNbCell(parent, 0, None), IPyNbCell(parent, 1, None)]
    _run(NotebookOutputs(out), items, ["skipped", "skipped"])
    assert nbformat.read(out / "t.ipynb", 4).metadata[RUN_KEY] == {"skipped": "why"}
    (out / "t.ipynb").unlink()
    _run(NotebookOutputs(out), [IPyNbCell(IPyNbFile(tmp_path, 2), 0, [])], ["passed"])
    assert not (out / "t.ipynb").exists()  # one cell of two ran: the last whole run stays
