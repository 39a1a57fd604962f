"""Options are declared once (``nbrpc._options.Options``); everything else follows from it.

No workers: these check that ``nbrpc.init``, ``nbrpc.Cluster``, the frozen ``Settings``,
``%rpc_init``'s arguments and help, and docs/options.md all know every option, and that
the magic and the function give the same settings for the same request.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing

import pytest
from IPython.core.magic_arguments import parse_argstring

import nbrpc
from nbrpc import _option_text, _options, _placement
from nbrpc._magics import RpcMagics

OPTIONS = _options.declared()


def test_settings_has_a_field_for_every_option_and_no_other():
    fields = [f.name for f in dataclasses.fields(_options.Settings)]
    whole = [
        name
        for name, opt in OPTIONS.items()
        if opt.part_of is None and name not in _placement.SOURCE_OPTIONS
    ]
    assert fields == [*whole, "source_options"], (
        "nbrpc._options.Settings must have one field per declared option, in the same order, "
        "none for an option that is part of another's value (part_of), and none for an "
        "engine source's own options (slurm): they are in the one field source_options"
    )


def test_an_option_part_of_a_value_names_one_of_its_fields():
    """``--nodes`` is ``Slurm.nodes``: the flag is declared in Options, the field only in the
    value's own class (the options class its source registered)."""
    parts = {name: opt.part_of for name, opt in OPTIONS.items() if opt.part_of}
    assert set(parts) >= {"nodes", "partition", "time", "gpus_per_node", "sbatch_args"}
    for name, part_of in parts.items():
        whole, _, field = part_of.partition(".")
        assert whole in OPTIONS, (name, part_of)
        assert OPTIONS[whole].part_of is None, (name, part_of)
        assert whole in _placement.SOURCE_OPTIONS, f"no options class registered for {whole}"
        value_type = _placement.SOURCE_OPTIONS[whole]
        assert field in {f.name for f in dataclasses.fields(value_type)}, (name, part_of)


def test_every_registered_source_options_class_is_an_option_of_its_own_type():
    """``slurm: bool | Slurm | None``: the option a source's value is given as takes its
    class; nbrpc.Slurm is registered under ``slurm`` and exported. ``--hosts`` and
    ``--profile`` take text (``typed = False``): their classes stay private."""
    assert _placement.SOURCE_OPTIONS["slurm"] is nbrpc.Slurm
    assert [c.__name__ for c in _placement.SOURCE_OPTIONS.values()] == [
        "Hosts",
        "Attached",
        "Slurm",
    ]
    hints = typing.get_type_hints(_options.Options)
    for source, cls in _placement.SOURCE_OPTIONS.items():
        assert cls.source == source
        assert OPTIONS[source].flag, f"{source} has no %rpc_init flag"
        if cls.typed:
            assert cls in typing.get_args(hints[source]), (source, cls)
            assert getattr(nbrpc, cls.__name__) is cls, f"nbrpc does not export {cls.__name__}"
        else:
            assert cls not in typing.get_args(hints[source]), (source, cls)


@dataclasses.dataclass(frozen=True)
class _Kube(_placement.SourceOptions):
    """A stand-in source's options (registered by the test that uses it, then gone)."""

    source = "kube"
    asks_for = "Kubernetes deployment"

    namespace: str | None = None
    replicas: int | None = None

    def check(self, v):
        if self.replicas is not None and self.replicas < 1:
            raise nbrpc.ConfigError(f"--replicas must be at least 1, got {self.replicas}")


@pytest.fixture
def kube(monkeypatch):
    """_Kube registered once, and its option and flags declared, as a new source adds them."""
    declared = _options.declared()
    monkeypatch.setattr(
        _options,
        "declared",
        lambda: {
            **declared,
            "kube": _options.Opt("--kube", "workers from Kubernetes", switch=(None, True)),
            "namespace": _options.Opt("--namespace", "with --kube", part_of="kube.namespace"),
            "replicas": _options.Opt("--replicas", "with --kube", part_of="kube.replicas"),
        },
    )
    monkeypatch.setattr(_placement, "SOURCE_OPTIONS", dict(_placement.SOURCE_OPTIONS))
    assert _placement.register(_Kube) is _Kube
    return _Kube


def test_a_new_sources_options_add_no_settings_field_and_reach_settings(kube):
    before = [f.name for f in dataclasses.fields(_options.Settings)]
    flat = _options.Settings.make(2, kube=True, namespace="ml", replicas=2)
    typed = _options.Settings.make(2, kube=kube(namespace="ml", replicas=2))
    assert [f.name for f in dataclasses.fields(_options.Settings)] == before
    assert "kube" not in before
    assert "namespace" not in before
    assert flat == typed
    assert flat.source_options == kube(namespace="ml", replicas=2)
    assert flat.options_of(kube) == kube(namespace="ml", replicas=2)
    assert flat.options_of(nbrpc.Slurm) is None
    assert flat.slurm is None
    assert _options.Settings.make(2).options_of(kube) is None
    for bad, says in (
        ({"namespace": "ml"}, r"--namespace shape a Kubernetes deployment: add --kube"),
        ({"kube": True, "replicas": 0}, "--replicas must be at least 1"),
        ({"kube": kube(), "namespace": "x"}, r"in nbrpc._Kube\(...\) or as keywords, not both"),
        ({"kube": "yes"}, r"kube='yes': use True or nbrpc._Kube"),
        ({"kube": True, "slurm": True}, r"--kube .*and --slurm|--slurm .*and --kube"),
        ({"kube": kube(), "slurm": nbrpc.Slurm()}, "use one"),
    ):
        with pytest.raises(nbrpc.ConfigError, match=says):
            _options.Settings.make(2, **bad)


def test_the_slurm_source_reads_its_job_from_the_generic_field():
    from nbrpc._engines import SlurmSource

    job = nbrpc.Slurm(nodes=2, gpus_per_node=1)
    settings = _options.Settings.make(2, slurm=True, nodes=2, gpus_per_node=1)
    assert settings.source_options == job == settings.options_of(nbrpc.Slurm) == settings.slurm
    assert settings.gpus == "auto"  # Slurm(gpus_per_node=...) implies a GPU per worker
    assert SlurmSource.wants(settings)
    assert not SlurmSource.wants(_options.Settings.make(2))


@pytest.mark.parametrize("func", [nbrpc.init, nbrpc.Cluster.__init__])
def test_init_and_cluster_take_every_option_typed(func):
    sig = inspect.signature(func)
    kwargs = [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
    assert kwargs, f"{func.__qualname__} takes **options"
    hints = typing.get_type_hints(func, include_extras=True)
    assert hints[kwargs[0].name] == typing.Unpack[_options.Options]


def test_init_documents_every_option():
    doc = nbrpc.init.__doc__ or ""
    missing = [name for name in OPTIONS if f"``{name}:" not in doc]
    assert not missing, f"nbrpc.init's docstring lacks {missing}"


def test_docs_options_md_is_generated_from_the_declaration():
    out = subprocess.run([sys.executable, "tools/options_doc.py", "--check"], check=False)
    assert out.returncode == 0, "docs/options.md is stale: run python tools/options_doc.py"


def test_every_flag_is_an_argument_of_rpc_init_with_its_help():
    parser = RpcMagics.rpc_init.parser
    flags = {a.dest: a for a in parser._actions}
    for name, opt in OPTIONS.items():
        if opt.flag is None:
            continue
        assert name in flags, f"%rpc_init has no argument for option {name} ({opt.flag})"
        assert opt.flag in flags[name].option_strings
        assert flags[name].help == opt.help
    assert "--quiet" in parser.format_help()


def test_an_unknown_option_is_refused_with_the_nearest_name():
    with pytest.raises(nbrpc.ConfigError, match=r"unknown option 'treads'.*'num_worker_threads'"):
        nbrpc.Cluster(2, treads=4)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"num_worker_threads": 0}, r"--threads 0: each process needs at least 1 RPC thread"),
        ({"num_worker_threads": -2}, r"--threads -2: each process needs at least 1"),
        ({"rpc_timeout": -5.0}, r"--timeout -5: a timeout is seconds, 0 or more"),
    ],
)
def test_a_thread_count_under_1_and_a_negative_timeout_are_refused(options, says):
    """Found by the soak (docs/soak.md): ``%rpc_init -n 2 --threads 0`` started a cluster
    of 16 threads per process, and a negative timeout went to torch."""
    with pytest.raises(nbrpc.ConfigError, match=says):
        nbrpc.Cluster(2, **options)


@pytest.mark.parametrize(
    ("line", "kwargs"),
    [
        ("", {}),
        ("-n 3 --names a,b,c", {"n": 3, "names": ["a", "b", "c"]}),
        (
            "--threads 4 --timeout 2.5 --self boss",
            {"num_worker_threads": 4, "rpc_timeout": 2.5, "self_name": "boss"},
        ),
        ("--no-shm", {"shm_threshold": None}),
        (
            "--device-map worker1=cuda:0->cuda:1 --device-map worker2=1->0",
            {"device_maps": {"worker1": {"cuda:0": "cuda:1"}, "worker2": {"1": "0"}}},
        ),
        (
            "--process-group gloo --process-group-workers worker2,worker1",
            {"process_group": "gloo", "process_group_workers": ["worker2", "worker1"]},
        ),
        (
            "--slurm --nodes 2 --partition gpu --time 10 --gpus-per-node 2 "
            "--sbatch-args '--account=ml --qos=high' --queue-timeout 30",
            {
                "slurm": nbrpc.Slurm(
                    nodes=2,
                    partition="gpu",
                    time="10",
                    gpus_per_node=2,
                    args=("--account=ml", "--qos=high"),
                    queue_timeout=30,
                )
            },
        ),
        (
            "--slurm --nodes 2 --sbatch-args '--exclusive'",
            {"slurm": True, "nodes": 2, "sbatch_args": ["--exclusive"]},
        ),
        (
            "--hosts h1,h1,h2 --listen 127.0.0.1 --ssh-args '-F cfg' --remote-python /p",
            {
                "hosts": "h1,h1,h2",
                "listen": "127.0.0.1",
                "ssh_args": "-F cfg",
                "remote_python": "/p",
            },
        ),
    ],
)
def test_the_magic_and_init_make_the_same_settings(line, kwargs):
    args = parse_argstring(RpcMagics.rpc_init, line)
    given = _option_text.from_flags(args)
    if "hosts" in kwargs:  # loopback cannot serve other hosts: both refuse it alike
        with pytest.raises(nbrpc.ConfigError, match="loopback") as magic:
            _options.Settings.make(**given)
        with pytest.raises(nbrpc.ConfigError, match="loopback") as python:
            _options.Settings.make(**kwargs)
        assert str(magic.value) == str(python.value)
        return
    assert _options.Settings.make(**given) == _options.Settings.make(**kwargs)
