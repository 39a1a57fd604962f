"""The controller's process (nbrpc._engines.controller_process): ipyparallel's own heart
monitor class, patched as the controller runs it, tells the hub of a new engine's heart at
its first answer instead of at the next ping."""

from ipyparallel.controller.heartmonitor import HeartMonitor

from nbrpc._engines import controller_process


def test_a_new_heart_is_told_at_its_first_answer_once_and_a_stale_answer_is_not():
    told: list[set] = []

    class Monitor(HeartMonitor):  # patched here, not ipyparallel's own class
        def handle_new_hearts(self, hearts):  # the hub's side: what it is told
            told.append(set(hearts))
            self.hearts.update(hearts)

    controller_process.registered_at_first_answer(Monitor)
    monitor = Monitor()
    monitor.lifetime, monitor.last_ping = 2.5, 2.0
    current = str(monitor.lifetime).encode("ascii")

    monitor.handle_pong([b"engine-a", current])
    assert told == [{b"engine-a"}]  # at once, not at the next ping
    monitor.handle_pong([b"engine-a", current])
    assert told == [{b"engine-a"}]  # known now: told once
    monitor.handle_pong([b"engine-b", b"1.0"])  # an answer to no ping of this monitor's
    assert told == [{b"engine-a"}]
    assert monitor.responses == {b"engine-a"}  # the next ping still sees it beat
