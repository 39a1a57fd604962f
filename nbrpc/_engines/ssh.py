"""Engines on other hosts: the kernel's controller on ``--listen``, engines over ssh.

ipyparallel launches and watches them: :class:`.ssh_launcher.HostEngineLauncher` is its
SSH engine launcher, with one ssh session where ipyparallel's opens about seven (see
there), and the engine is ipyparallel's, run by ``python -m nbrpc._engines.zygote
--engine`` (torch imported before it registers; ``os._exit`` when it stops, so an engine
that lost its controller does not wait in torch's exit handlers). Every ssh of a cluster
shares one connection per host (OpenSSH's ControlMaster, closed at release). The engine's
environment says which ``--hosts`` entry it was started for, so workers are named in list
order whatever order engines register in.

What a remote engine leaves on its host lives in one directory per controller
(``~/.nbrpc/run-<cluster id>``: the connection file, engine logs), removed with the
engines at shutdown together with the run's shared-memory segments. A fresh directory per
controller also means a connection file from an earlier (killed) controller is never read.

Engines stop by themselves ``ENGINE_ORPHAN_MISSES`` heartbeats (10 s) after the controller
is gone, and their pids are never given to the kernel's watchdog: they are pids of other
hosts. The watchdog only stops this host's controller and ssh connections.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nbrpc import _fence, _options, _process, _timers
from nbrpc._errors import BootError, ConfigError, counted
from nbrpc._source_options import Hosts
from nbrpc._wire import stack_dumps

from . import controller, hosts, watchdog, worker
from .controller import ENGINE_ARGS, Controller, ControllerSource, tail
from .ssh_launcher import (
    SSH_TIMEOUT_S,
    WATCH_POLL_S,
    HostEngineLauncher,
    HostEngineSetLauncher,
    run_on,
)

log = logging.getLogger("nbrpc")

#: Set for every remote engine: the ``--hosts`` entry it was started for.
HOST_ENV = "NBRPC_HOST_ENTRY"


class HostController(Controller):
    """A controller on ``listen`` and the engines it runs on other hosts."""

    def __init__(self, listen: str, plan: hosts.HostPlan, python: str) -> None:
        self.listen = listen
        self.plan = plan
        self.python = plan.remote_python or python
        workdir = tempfile.mkdtemp(prefix="nbrpc-hosts-")
        control = [
            "-o",
            "ControlMaster=auto",
            "-o",
            f"ControlPath={workdir}/%C",
            "-o",
            "ControlPersist=60",
        ]
        self.ssh_args = [*control, *hosts.ssh_options(plan.ssh_args)]
        self.scp_args = [*control, *hosts.scp_args(plan.ssh_args)]
        try:  # before anything starts; its ssh connections then serve the engines' starts
            hosts.preflight(plan, self.python, listen, self.ssh_args)
        except BaseException:
            self._close_connections()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        super().__init__(listen, workdir, HostEngineSetLauncher)
        self.remote_dir = f".nbrpc/run-{self._ipp.cluster_id}"
        self._launchers: list[HostEngineLauncher] = []
        self.entry_of: dict[int, str] = {}  # engine id -> its --hosts entry
        self._retired: set[int] = set()  # engine ids a shrink stopped
        self._start_controller()

    @property
    def key(self) -> tuple:
        return ("hosts", self.listen, self.plan, self.python)

    @property
    def log_dir(self) -> str:
        return f"~/{self.remote_dir}/log on each host"

    # -- engines ---------------------------------------------------------------------

    def spawn(self, n: int) -> None:
        """Start one engine per ``--hosts`` entry (one ssh session each, hosts in
        parallel): ``n`` is their count (the settings made it so)."""
        self._start_on(list(self.plan.entries))

    def _start_on(self, entries: list[str]) -> None:
        """Start one engine on each of ``entries`` (all of them, or a restart's)."""
        engines = {
            host: {"n": n, "environment": {HOST_ENV: host}}
            for host, n in hosts.counts(tuple(entries)).items()
        }
        try:
            set_id = self._ipp.start_engines_sync(
                len(entries),
                engines=engines,
                ssh_args=self.ssh_args,
                scp_args=self.scp_args,
                remote_python=self.python,
                engine_cmd=[self.python, "-m", "nbrpc._engines.zygote", "--engine"],
                remote_profile_dir=self.remote_dir,
                engine_args=list(ENGINE_ARGS),
                delay=0,
            )
        except BootError:
            raise
        except Exception as exc:
            raise BootError(f"could not start engines over ssh: {exc}") from exc
        self._launchers += list(self._ipp.engines[set_id].launchers.values())

    def take(self, n: int, timeout: float, registered: Callable[..., None]) -> list[int]:
        """Engine ids in ``--hosts`` order, once every engine registered (one per entry:
        ``n`` is their count)."""
        n = len(self.plan.entries)
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            ids = sorted(client.ids)
            registered(len(ids))
            if len(ids) >= n:
                break
            for la in self._launchers:
                if la.state == "after":
                    raise BootError(
                        f"the engine on {la.location} exited before it registered. Its "
                        f"output:\n{tail(la.get_output())}"
                    )
            if time.monotonic() > deadline:
                raise BootError(
                    f"only {len(ids)} of {counted(n, 'engine')} on other hosts registered with the "
                    f"controller at {self.listen} within {timeout:.0f} s. Engines connect "
                    f"back to this host: check that the hosts reach {self.listen} "
                    f"(docs/multi-host.md), and the logs in {self.log_dir}"
                )
            time.sleep(0.05)
        entries = client[ids].apply_async(worker.host_entry).get(timeout=30)
        by_entry: dict[str, list[int]] = {}
        for eid, entry in zip(ids, entries, strict=True):
            by_entry.setdefault(entry, []).append(eid)
        taken = [by_entry[entry].pop(0) for entry in self.plan.entries]
        self.entry_of.update(zip(taken, self.plan.entries, strict=True))
        return taken

    def replace(self, engine_ids: list[int], pids: list[int], timeout: float) -> list[int]:
        """Kill engines on their hosts (over ssh), start new ones on the same entries, and
        return their ids once registered, in that order."""
        entries = [self.entry_of[eid] for eid in engine_ids]
        self._kill(entries, pids)
        client = self.client()
        deadline = time.monotonic() + timeout
        while any(eid in client.ids for eid in engine_ids) and time.monotonic() < deadline:
            time.sleep(0.05)  # the heart monitor notices (about 2 s)
        return self.start_more(entries, max(1.0, deadline - time.monotonic()))

    def _kill(self, entries: list[str], pids: list[int]) -> None:
        by_host = {la.location: la for la in self._launchers}
        for entry, pid in zip(entries, pids, strict=True):
            launcher = by_host.get(entry)
            if launcher is not None:
                self._quietly(launcher, f"kill -9 {int(pid)} 2>/dev/null; true")

    def start_more(self, entries: list[str], timeout: float) -> list[int]:
        """Start one engine on each of ``entries`` (a restart's, or a grow's) and return
        their ids once registered, in that order."""
        client = self.client()
        deadline = time.monotonic() + timeout
        known = set(client.ids) | set(self.entry_of) | self._retired
        self._start_on(entries)
        new: list[int] = []
        while True:
            fresh = sorted(set(client.ids) - known)
            if len(fresh) >= len(entries):
                break
            if time.monotonic() > deadline:
                raise BootError(
                    f"no new engine on {', '.join(entries)} registered within {timeout:.0f} s; "
                    f"the logs are in {self.log_dir}"
                )
            time.sleep(0.05)
        on = dict(
            zip(fresh, client[fresh].apply_async(worker.host_entry).get(timeout=30), strict=True)
        )
        for entry in entries:
            eid = next(e for e in fresh if on[e] == entry and e not in new)
            new.append(eid)
            self.entry_of[eid] = entry
        return new

    def next_entries(self, n: int) -> list[str]:
        """Where ``n`` more engines go: round-robin over the ``--hosts`` entries given at
        init, each time the one with the fewest engines of this cluster (list order wins
        a tie)."""
        load = {e: 0 for e in self.plan.entries}
        for entry in self.entry_of.values():
            if entry in load:
                load[entry] += 1
        chosen = []
        for _ in range(n):
            entry = min(self.plan.entries, key=lambda e: (load[e], self.plan.entries.index(e)))
            load[entry] += 1
            chosen.append(entry)
        return chosen

    def check_new_hosts(self, entries: list[str]) -> None:
        """Hosts a grow names that the cluster does not run on yet: admitted through the
        member filter, then checked as at init (the preflight); a host that fails it is
        let go of again, and nothing started."""
        new = tuple(e for e in hosts.counts(tuple(entries)) if e not in self.plan.entries)
        if not new:
            return
        admitted = _fence.members()
        added = set(hosts.addresses(new, self.plan.ssh_args))
        if admitted is not None:
            _fence.admit(admitted | added)
            for pid in self.controller_pids():
                with contextlib.suppress(OSError):
                    _fence.fence_process(pid)
        try:
            hosts.preflight(
                replace(self.plan, entries=new), self.python, self.listen, self.ssh_args
            )
        except BaseException:
            if admitted is not None:
                _fence.admit(admitted)
            raise
        self.plan = replace(self.plan, entries=self.plan.entries + new)

    def forget(self, engine_ids: list[int], pids: list[int]) -> None:
        """Stop some engines (a shrink): asked to exit, killed on their hosts if not."""
        self.ask_to_exit(engine_ids)
        entries = [self.entry_of.pop(eid, "") for eid in engine_ids]
        self._retired.update(engine_ids)
        deadline = time.monotonic() + controller.ENGINE_EXIT_WAIT_S
        while self._client is not None and time.monotonic() < deadline:
            if not any(eid in self._client.ids for eid in engine_ids):
                break
            time.sleep(0.05)
        self._kill(entries, pids)  # what is left of them (their pids are gone otherwise)

    def dump_stacks(
        self, engine_ids: list[int], pids: list[int], timeout: float
    ) -> dict[int, dict[str, Any]]:
        """Run :mod:`nbrpc._wire.stacks` as a script on each host (all hosts at once, one
        ssh each over the open connection); its parts by engine id."""
        by_host = {la.location: la for la in self._launchers}

        def run(entry: str, argv: list[str]) -> str:
            launcher = by_host.get(entry)
            if launcher is None:
                raise BootError(f"no ssh connection to {entry!r}")
            script = shlex.join([self.python, *argv])
            return run_on(launcher, script, timeout=timeout + SSH_TIMEOUT_S)

        where = zip(engine_ids, pids, strict=True)
        return stack_dumps.gather(
            {eid: (self.entry_of.get(eid, ""), pid) for eid, pid in where}, run
        )

    def retire(self, engine_ids: list[int], pids: list[int]) -> None:
        """Stop the engines (ask, then kill what is left on each host: the pids its
        launchers know) and remove the run's files there."""
        self.ask_to_exit(engine_ids)
        deadline = time.monotonic() + controller.ENGINE_EXIT_WAIT_S
        by_host = {la.location: la for la in self._launchers}
        on_host = {h: [la.pid for la in self._launchers if la.location == h] for h in by_host}
        segments = f"/dev/shm/{watchdog.segment_prefix(os.getpid())}-*"
        scripts = []
        for host, la in by_host.items():
            alive = " ".join(str(p) for p in on_host[host])
            script = (
                f"for i in $(seq {int(controller.ENGINE_EXIT_WAIT_S * 10)}); do "
                f"alive=0; for p in {alive}; do kill -0 $p 2>/dev/null && alive=1; done; "
                f"[ $alive = 0 ] && break; sleep 0.1; done; "
                f"kill -9 {alive} 2>/dev/null; cd; "
                f"rm -rf {shlex.quote(self.remote_dir)} {segments}; "
                "rmdir .nbrpc 2>/dev/null; true"
            )
            scripts.append((la, script))
        wait = max(1.0, deadline - time.monotonic() + SSH_TIMEOUT_S)
        _timers.at_once(self._quietly, scripts, wait)
        for la in self._launchers:  # their watch loops see the exit within a second
            with contextlib.suppress(Exception):
                la._stop_waiting.set()
                la._wait_thread.join(3 * WATCH_POLL_S)
        self._launchers = []

    @staticmethod
    def _quietly(launcher: HostEngineLauncher, script: str) -> None:
        try:
            run_on(launcher, script)
        except BootError as exc:
            log.warning("stopping engines on %s: %s", launcher.location, exc)

    def release(self) -> None:
        """Stop the controller, the ssh connections and the watchdog (engines: retire)."""
        self._stop_processes()
        with contextlib.suppress(Exception):
            self._ipp.engines.clear()
            self._ipp.stop_cluster_sync()
        self._close_connections()
        self._stop_watchdog()
        watchdog.remove_cluster_files(self.cluster_file)
        self._stop_loop()

    def _close_connections(self) -> None:
        """Close the shared ssh connection to each host (OpenSSH's ``-O exit``)."""
        for entry in hosts.counts(self.plan.entries):
            subprocess.run(
                ["ssh", *self.ssh_args, "-O", "exit", entry],
                capture_output=True,
                timeout=10,
                check=False,
            )


class SshSource(ControllerSource[HostController]):
    """Engines on other hosts over ssh (``--hosts``), one per entry, in list order."""

    cannot_replace = ""
    cannot_scale = ""

    @classmethod
    def wants(cls, settings: _options.Settings) -> bool:
        return settings.options_of(Hosts) is not None

    @classmethod
    def resolve(cls, settings: _options.Settings) -> _options.Settings:
        """``--listen`` defaults to this host's address on the route to the first host."""
        asked = settings.options_of(Hosts)
        if settings.listen or asked is None or not asked.entries:
            return settings
        return replace(settings, listen=hosts.infer_listen(asked.entries[0], asked.ssh_args))

    def _asked(self) -> Hosts:
        asked = self.settings.options_of(Hosts)
        assert asked is not None, "wants() took it for these settings"
        return asked

    def start(self) -> None:
        s, asked = self.settings, self._asked()
        assert s.listen, "resolve() works out --listen"
        plan = hosts.HostPlan(asked.entries, asked.ssh_args, s.remote_python or "")
        with _process.interrupts_deferred():  # kept, so that a stop's cleanup finds it
            self.controller = HostController(s.listen, plan, s.python)

    def hosts(self) -> list[str]:
        asked = self._asked()
        return hosts.addresses(asked.entries, asked.ssh_args)

    def last_output(self, pid: int) -> str:
        return ""  # pids of other hosts: their logs stay there

    def replace(self, engine_ids: list[int], pids: list[int], timeout: float) -> list[int]:
        return self._ours().replace(engine_ids, pids, timeout)

    def check_hosts(self, hosts: tuple[str, ...]) -> None:
        bad = [h for h in hosts if not h or h.startswith("-") or any(c.isspace() for c in h)]
        if bad:
            raise ConfigError(f"--hosts {','.join(hosts)}: {bad[0]!r} is not a host")

    def grow(
        self, n: int, hosts: tuple[str, ...], timeout: float, registered: Callable[..., None]
    ) -> list[int]:
        """On ``hosts`` (preflighted if new), else round-robin over the init's entries."""
        ours = self._ours()
        entries = [hosts[i % len(hosts)] for i in range(n)] if hosts else ours.next_entries(n)
        ours.check_new_hosts(entries)
        return ours.start_more(entries, timeout)

    def shrink(self, engine_ids: list[int], pids: list[int]) -> None:
        self._ours().forget(engine_ids, pids)
