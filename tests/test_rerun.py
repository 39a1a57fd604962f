"""PyTorch's RPC code re-run as a notebook re-runs it, in a real kernel: ranks after a
re-init, the kernel's name kept, errors through nested calls and RRef proxies."""

from __future__ import annotations

import pytest
from conftest import running_kernel

NESTED = """
import torch.distributed.rpc as rpc

def inner():
    return [][1]

def relay(to):
    return rpc.rpc_sync(to, inner)

class C:
    def f(self):
        return [][1]

class Broken:  # its constructor raises: the RRef remote() gives holds the error
    def __init__(self):
        [][1]

    def f(self):
        return 1

def my_rank():
    return nbrpc.rank(), rpc.get_worker_info().id

def gather():  # torch's own collective over RPC, which its barriers use
    from torch.distributed.rpc import api
    return sorted(api._all_gather(rpc.get_worker_info().name, timeout=30).values())

def gather_everywhere():
    from torch.distributed.rpc import api
    futs = [rpc.rpc_async(w, gather) for w in nbrpc.workers()[1:]]
    return [sorted(api._all_gather(nbrpc.workers()[0], timeout=30).values())] + [
        f.wait() for f in futs
    ]
"""


@pytest.fixture(scope="module")
def kernel():
    with running_kernel(
        "%load_ext nbrpc",
        "%rpc_init --names ps --self master --quiet",
        "import nbrpc\n" + NESTED,
        closing="%rpc_shutdown",
    ) as k:
        yield k


@pytest.mark.parametrize(
    "call",
    [
        "rpc.rpc_sync('ps', relay, args=('master',))",
        "rpc.remote('ps', C).rpc_sync().f()",
        "rpc.remote('ps', C).rpc_async().f().wait()",
        "rpc.remote('ps', C).remote().f().to_here()",
        # the value's creation failed: what the pipeline tutorial run as printed does on a
        # host without CUDA (its shards' .to("cuda:0")), through the proxies it calls
        "rpc.remote('ps', Broken).to_here()",
        "rpc.remote('ps', Broken).rpc_sync().f()",
        "rpc.remote('ps', Broken).rpc_async().f().wait()",
        "rpc.remote('ps', Broken).remote().f().to_here()",
    ],
)
def test_an_error_keeps_its_type_and_shows_once_per_hop(kernel, call):
    _, errors = kernel.execute(call)
    assert errors == ["IndexError: list index out of range"]
    text = kernel.shown_error()
    assert text.count("IndexError: list index out of range") == 1 + text.count(
        "Remote traceback"
    ), text
    assert "nbrpc #" not in text
    assert "ipykernel_" not in text  # the cells as the notebook names them, on every hop
    assert "failures.py" not in text
    assert "rref_proxy.py" not in text
    assert "RuntimeError" not in text
    hops = 2 if "relay" in call else 1
    assert text.count("Remote traceback (most recent call last), on ") == hops, text
    if "Broken" in call:  # where it was raised, as the notebook names the cell
        assert "Cell In[" in text.split("on ps:", 1)[1].split("\n")[1], text


def test_ranks_and_the_kernels_name_after_a_re_init(kernel):
    """torch's ids continue after a re-init (the kernel's agent joins once); nbrpc.rank()
    gives the ranks a script has. A later %rpc_init keeps --self without being asked."""
    assert kernel.value("gather_everywhere()") == [["master", "ps"]] * 2
    kernel.run("%rpc_shutdown")
    kernel.run("%rpc_init -n 2 --quiet  # no --self: the kernel stays 'master'")
    assert kernel.value("nbrpc.workers()") == ["master", "worker1", "worker2"]
    assert kernel.value("[nbrpc.rank(), nbrpc.rank('worker2')]") == [0, 2]
    mine = kernel.value("[rpc.rpc_sync(w, my_rank) for w in ('worker1', 'worker2')]")
    assert [rank for rank, _ in mine] == [1, 2]
    assert [torch_id for _, torch_id in mine] == [2, 3]  # after ps (1): docs/architecture.md
    everyone = ["master", "worker1", "worker2"]
    for _ in range(2):  # torch's _all_gather spans the cluster, also in a re-run kernel
        assert kernel.value("gather_everywhere()") == [everyone] * 3
    _, errors = kernel.execute("%rpc_init -n 1 --self agent")
    assert errors[0].startswith("AlreadyInitializedError") or "kernel restart" in errors[0]
    kernel.run("%rpc_shutdown")
    _, errors = kernel.execute("%rpc_init -n 1 --self agent")
    assert "torch fixes a process's name for its lifetime" in errors[0]
    assert "Without --self, %rpc_init keeps 'master'" in errors[0]
    assert "starting" not in kernel.stderr  # refused before any progress was drawn
    kernel.run("%rpc_init --names ps --quiet")
    assert kernel.value("nbrpc.rank('ps')") == 1
    # the same names as the first cluster: the new ps counts its gathers from 0, and so
    # must the kernel (torch numbers them per set of names)
    assert kernel.value("gather_everywhere()") == [["master", "ps"]] * 2


BATCH_RL = '''
import threading

import numpy as np
import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef
from torch.distributions import Categorical

import nbrpc

NUM_STEPS = 12
AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"
GAMMA = 0.99


class CartPole:
    """Stands in for gym's CartPole-v1 (not installed here): the same shapes and API."""

    def __init__(self):
        self.rng = np.random.default_rng(0)
        self.steps = 0

    def seed(self, seed):
        self.rng = np.random.default_rng(seed)

    def reset(self):
        self.steps = 0
        return self.rng.normal(size=4)

    def step(self, action):
        self.steps += 1
        return self.rng.normal(size=4), 1.0, self.steps >= 5 + action, {}


class Policy(nn.Module):
    def __init__(self, batch=True):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.dim = 2 if batch else 1

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=self.dim)


class Observer:
    def __init__(self, batch=True):
        # the tutorial: rpc.get_worker_info().id - 1, a script's rank; torch's ids go on
        # counting after a re-init, nbrpc.rank() is the script's rank in every cluster
        self.id = nbrpc.rank() - 1
        self.env = CartPole()
        self.env.seed(1)
        self.select_action = Agent.select_action_batch

    def run_episode(self, agent_rref, n_steps):
        state, ep_reward = self.env.reset(), NUM_STEPS
        rewards = torch.zeros(n_steps)
        start_step = 0
        for step in range(n_steps):
            state = torch.from_numpy(state).float().unsqueeze(0)
            action = rpc.rpc_sync(
                agent_rref.owner(), self.select_action, args=(agent_rref, self.id, state)
            )
            state, reward, done, _ = self.env.step(action)
            rewards[step] = reward
            if done or step + 1 >= n_steps:
                curr_rewards = rewards[start_step : (step + 1)]
                R = 0
                for i in range(curr_rewards.numel() - 1, -1, -1):
                    R = curr_rewards[i] + GAMMA * R
                    curr_rewards[i] = R
                state = self.env.reset()
                if start_step == 0:
                    ep_reward = min(ep_reward, step - start_step + 1)
                start_step = step + 1
        return [rewards, ep_reward]


class Agent:
    def __init__(self, world_size, batch=True):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.policy = Policy(batch)  # the tutorial's .cuda() left out: no GPU here
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.running_reward = 0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(rpc.remote(ob_info, Observer, args=(batch,)))
            self.rewards[ob_info.id] = []
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        self.batch = batch
        self.saved_log_probs = []
        self.future_actions = torch.futures.Future()
        self.lock = threading.Lock()
        self.pending_states = len(self.ob_rrefs)

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref, ob_id, state):
        self = agent_rref.local_value()
        self.states[ob_id].copy_(state)
        future_action = self.future_actions.then(
            lambda future_actions: future_actions.wait()[ob_id].item()
        )
        with self.lock:
            self.pending_states -= 1
            if self.pending_states == 0:
                self.pending_states = len(self.ob_rrefs)
                # the tutorial's self.states.cuda() made the copy autograd keeps
                probs = self.policy(self.states.clone())
                m = Categorical(probs)
                actions = m.sample()
                self.saved_log_probs.append(m.log_prob(actions).t())
                future_actions = self.future_actions
                self.future_actions = torch.futures.Future()
                future_actions.set_result(actions)
        return future_action

    def run_episode(self, n_steps=0):
        futs = []
        for ob_rref in self.ob_rrefs:
            futs.append(ob_rref.rpc_async().run_episode(self.agent_rref, n_steps))
        rets = torch.futures.wait_all(futs)
        rewards = torch.stack([ret[0] for ret in rets]).t()
        ep_rewards = sum([ret[1] for ret in rets]) / len(rets)
        probs = torch.stack(self.saved_log_probs)
        policy_loss = -probs * rewards / len(rets)
        policy_loss.sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.saved_log_probs = []
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        self.running_reward = 0.5 * ep_rewards + 0.5 * self.running_reward
        return ep_rewards, self.running_reward
'''

RUN_EPISODES = """
agent = Agent(world_size=3)
for i_episode in range(2):
    ep_reward, running = agent.run_episode(n_steps=NUM_STEPS)
    print(f"episode {i_episode}: reward {ep_reward:.1f}, ids {sorted(agent.rewards)}")
"""


def test_the_batch_rl_tutorial_runs_again_after_a_re_init():
    """PyTorch's batch-RL tutorial (rpc_async_execution) with a stand-in environment, run
    twice in one kernel with a re-init between, as a notebook is re-run: torch's ids are
    1, 2 and then 3, 4; nbrpc.rank() gives the observers 1 and 2 both times."""
    with running_kernel(
        "%load_ext nbrpc",
        "%rpc_init --names observer1,observer2 --self agent --quiet",
        BATCH_RL,
    ) as k:
        first = k.run(RUN_EPISODES)
        assert "episode 1: reward" in first, first
        assert "ids [1, 2]" in first
        k.run("%rpc_shutdown")
        k.run("%rpc_init --names observer1,observer2 --quiet  # the kernel stays 'agent'")
        again = k.run(RUN_EPISODES)
        assert "episode 1: reward" in again, again
        assert "ids [3, 4]" in again  # torch's own ids, which the tutorial's indexing broke on
