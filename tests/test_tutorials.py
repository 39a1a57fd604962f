"""PyTorch's RPC tutorials run in a real kernel as a person runs them: their code as the
tutorials print it, cell by cell, with stand-in data and environments, on CPU, and with
only the start-up replaced by ``%rpc_init --names ... --self ...``. Where a tutorial's own
code is wrong (its typos, a GPU it assumes, an attribute it never sets), the cell fixes it
and a comment says what the tutorial had.

- ``rpc_tutorial`` (intermediate/rpc_tutorial): its RNN part (embedding table and decoder
  on ``ps``, the LSTM in the kernel, distributed autograd and the DistributedOptimizer),
  then in the same kernel its RL part (an agent in the kernel, observers on workers, RPCs
  both ways through RRef proxies). The kernel joined as ``trainer``; the RL part's
  ``--self agent`` is refused as docs/errors.md says, and without ``--self`` it runs, its
  "Ctrl+C to exit" the stop button.
- ``dist_pipeline_parallel_tutorial``: a ResNet in two shards on two workers, micro-batches
  pipelined with ``remote``/``rpc_async``, one step compared with the same model run whole
  in the kernel; and its CUDA shards as printed, on a host without CUDA.
"""

from __future__ import annotations

import re

import pytest
from conftest import running_kernel

# -- rpc_tutorial, its RNN part ---------------------------------------------------------------

RNN_PART = '''
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef


# _call_method and _remote_method: the tutorial calls _remote_method without showing it;
# these are pytorch/examples' (distributed/rpc/rnn/rnn.py), which the tutorial comes from
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(
        rref.owner(), _call_method, args=[method, rref] + list(args), kwargs=kwargs
    )


class EmbeddingTable(nn.Module):
    r"""
    Encoding layers of the RNNModel
    """
    def __init__(self, ntoken, ninp, dropout):
        super(EmbeddingTable, self).__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)  # the tutorial: .cuda(); no GPU here
        self.encoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, input):
        # the tutorial: self.drop(self.encoder(input.cuda()).cpu() (a parenthesis short)
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid, dropout):
        super(Decoder, self).__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.bias.data.zero_()
        self.decoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, output):
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super(RNNModel, self).__init__()

        # setup embedding table remotely
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        # setup LSTM locally
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        # setup decoder remotely
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        # pass input to the remote embedding table and fetch emb tensor back
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        # pass output to the rremote decoder and get the decoded output back
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        remote_params = []
        # get RRefs of embedding table
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        # create RRefs for local parameters
        remote_params.extend(_parameter_rrefs(self.rnn))
        # get RRefs of decoder
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params


def _parameter_rrefs(module):
    param_rrefs = []
    for param in module.parameters():
        param_rrefs.append(RRef(param))
    return param_rrefs
'''

RUN_TRAINER = """
def run_trainer():
    batch = 5
    ntoken = 10
    ninp = 2

    nhid = 3
    nindices = 3
    nlayers = 4
    hidden = (
        torch.randn(nlayers, nindices, nhid),
        torch.randn(nlayers, nindices, nhid)
    )

    model = RNNModel('ps', ntoken, ninp, nhid, nlayers)  # the tutorial: rnn.RNNModel

    # setup distributed optimizer
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=0.05,
    )

    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():
        for _ in range(5):
            # the tutorial: torch.LongTensor(batch, nindices) % ntoken, memory never
            # written; random tokens stand in
            data = torch.randint(0, ntoken, (batch, nindices))
            target = torch.randint(0, nindices, (batch, ntoken))
            yield data, target

    # train for 10 iterations
    for epoch in range(10):
        for data, target in get_next_batch():
            # create distributed autograd context
            with dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output, target)
                # run distributed backward pass
                dist_autograd.backward(context_id, [loss])
                # run distributed optimizer
                opt.step(context_id)
                # not necessary to zero grads since they are
                # accumulated into the distributed autograd context
                # which is reset every iteration.
        print("Training epoch {}".format(epoch))

run_trainer()  # the tutorial's glue calls _run_trainer(), a name it never defines
"""

#: The test's own cell: one training step of the tutorial's model (dropout 0, so that both
#: sides compute the same thing) against a copy of it run whole in the kernel.
RNN_ONE_STEP = """
import copy

def weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}

def grads(module, context_id):
    on_here = dist_autograd.get_gradients(context_id)
    return [on_here[p] for p in module.parameters()]

torch.manual_seed(0)
model = RNNModel('ps', 10, 2, 3, 4, dropout=0.0)
emb, dec = EmbeddingTable(10, 2, 0.0), Decoder(10, 3, 0.0)
emb.load_state_dict(_remote_method(weights, model.emb_table_rref))
dec.load_state_dict(_remote_method(weights, model.decoder_rref))
rnn = copy.deepcopy(model.rnn)

opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
data, target = torch.randint(0, 10, (5, 3)), torch.randint(0, 3, (5, 10))
hidden = (torch.randn(4, 3, 3), torch.randn(4, 3, 3))
criterion = torch.nn.CrossEntropyLoss()

with dist_autograd.context() as context_id:
    output, _ = model(data, hidden)
    loss = criterion(output, target)
    dist_autograd.backward(context_id, [loss])
    got = (
        _remote_method(grads, model.emb_table_rref, context_id)
        + grads(model.rnn, context_id)
        + _remote_method(grads, model.decoder_rref, context_id)
    )
    opt.step(context_id)

local = [emb, rnn, dec]
params = [p for m in local for p in m.parameters()]
local_loss = criterion(dec(rnn(emb(data), hidden)[0]), target)
local_loss.backward()
want = [p.grad for p in params]
with torch.no_grad():
    for p in params:
        p -= 0.05 * p.grad
stepped = (
    list(_remote_method(weights, model.emb_table_rref).values())
    + [p.detach() for p in model.rnn.parameters()]
    + list(_remote_method(weights, model.decoder_rref).values())
)
report = {
    "loss": [loss.item(), local_loss.item()],
    "grads": len(got),
    "nonzero": sum(bool(g.abs().sum() > 0) for g in got),
    "grads_match": all(torch.allclose(g, w, rtol=1e-5, atol=1e-7) for g, w in zip(got, want)),
    "weights_match": all(
        torch.allclose(s, p.detach(), rtol=1e-5, atol=1e-7) for s, p in zip(stepped, params)
    ),
}
"""

# -- rpc_tutorial, its RL part ------------------------------------------------------------------

#: What gym's CartPole-v1 would be (gym is not installed here): gym's old API, which the
#: tutorial uses (seed; reset() -> state; step(action) -> state, reward, done, info), a
#: state of 4 floats, deterministic: every episode lasts EPISODE_STEPS steps, reward 1 each.
STAND_IN_GYM = """
from types import SimpleNamespace

import numpy as np

EPISODE_STEPS = 5
REWARD_THRESHOLD = 1.0  # CartPole-v1's is 475.0: a few episodes here


class CartPoleStandIn:
    spec = SimpleNamespace(reward_threshold=REWARD_THRESHOLD)

    def seed(self, seed):
        self.start = float(seed)

    def reset(self):
        self.t = 0
        self.state = np.array([self.start, 0.0, 0.01, 0.0])
        return self.state

    def step(self, action):
        self.t += 1
        self.state = self.state + np.array([0.1, 0.2 * action - 0.1, 0.0, 0.01])
        return self.state, 1.0, self.t >= EPISODE_STEPS, {}


gym = SimpleNamespace(make=lambda name: CartPoleStandIn())
"""

RL_PART = """
import torch.nn as nn
import torch.nn.functional as F


class Policy(nn.Module):

    def __init__(self):
        super(Policy, self).__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


import torch.distributed.rpc as rpc

# the tutorial: argparse's parse_args(), which in a kernel parses the kernel's own command
# line (-f CONNECTION_FILE) and exits; its defaults, with a world of an agent and two
# observers and a line printed every episode
args = SimpleNamespace(world_size=3, log_interval=1, gamma=0.99, seed=1)


class Observer:

    def __init__(self):
        self.id = rpc.get_worker_info().id
        self.env = gym.make('CartPole-v1')
        self.env.seed(args.seed)

    def run_episode(self, agent_rref):
        state, ep_reward = self.env.reset(), 0
        for _ in range(10000):
            # send the state to the agent to get an action
            action = agent_rref.rpc_sync().select_action(self.id, state)

            # apply the action to the environment, and get the reward
            state, reward, done, _ = self.env.step(action)

            # report the reward to the agent for training purpose
            agent_rref.rpc_sync().report_reward(self.id, reward)

            # finishes after the number of self.env._max_episode_steps
            if done:
                break


import numpy as np

import torch
import torch.optim as optim
from torch.distributed.rpc import RRef, rpc_async, remote
from torch.distributions import Categorical


class Agent:
    def __init__(self, world_size):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = np.finfo(np.float32).eps.item()
        self.running_reward = 0
        self.reward_threshold = gym.make('CartPole-v1').spec.reward_threshold
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        state = torch.from_numpy(state).float().unsqueeze(0)
        probs = self.policy(state)
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self):
        futs = []
        for ob_rref in self.ob_rrefs:
            # make async RPC to kick off an episode on all observers
            futs.append(
                rpc_async(
                    ob_rref.owner(),
                    ob_rref.rpc_sync().run_episode,
                    args=(self.agent_rref,)
                )
            )

        # wait until all obervers have finished this episode
        for fut in futs:
            fut.wait()

    def finish_episode(self):
      # joins probs and rewards from different observers into lists
      R, probs, rewards = 0, [], []
      for ob_id in self.rewards:
          probs.extend(self.saved_log_probs[ob_id])
          rewards.extend(self.rewards[ob_id])

      # use the minimum observer reward to calculate the running reward
      min_reward = min([sum(self.rewards[ob_id]) for ob_id in self.rewards])
      self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward

      # clear saved probs and rewards
      for ob_id in self.rewards:
          self.rewards[ob_id] = []
          self.saved_log_probs[ob_id] = []

      policy_loss, returns = [], []
      for r in rewards[::-1]:
          R = r + args.gamma * R
          returns.insert(0, R)
      returns = torch.tensor(returns)
      returns = (returns - returns.mean()) / (returns.std() + self.eps)
      for log_prob, R in zip(probs, returns):
          policy_loss.append(-log_prob * R)
      self.optimizer.zero_grad()
      policy_loss = torch.cat(policy_loss).sum()
      policy_loss.backward()
      self.optimizer.step()
      return min_reward


from itertools import count

AGENT_NAME = "agent"
OBSERVER_NAME="obs{}"
"""

#: The rank-0 branch of the tutorial's run_worker, as a cell (init_rpc is %rpc_init's).
RUN_AGENT = """
agent = Agent(args.world_size)
print(f"This will run until reward threshold of {agent.reward_threshold}"
        " is reached. Ctrl+C to exit.")
for i_episode in count(1):
    agent.run_episode()
    last_reward = agent.finish_episode()

    if i_episode % args.log_interval == 0:
        print(f"Episode {i_episode}\\tLast reward: {last_reward:.2f}\\tAverage reward: "
            f"{agent.running_reward:.2f}")
    if agent.running_reward > agent.reward_threshold:
        print(f"Solved! Running reward is now {agent.running_reward}!")
        break
"""


@pytest.fixture(scope="class")
def rpc_tutorial_kernel():
    with running_kernel(
        "%load_ext nbrpc",
        "%rpc_init --names ps --self trainer --quiet  # the RNN part's processes",
        RNN_PART,
        closing="%rpc_shutdown",
    ) as k:
        yield k


class TestRpcTutorial:
    """Both parts of rpc_tutorial in one kernel, the RNN part first."""

    @pytest.fixture
    def kernel(self, rpc_tutorial_kernel):
        return rpc_tutorial_kernel

    def test_the_rnn_part_trains_as_one_process_would(self, kernel):
        assert kernel.value("rpc.get_worker_info().name") == "trainer"
        out = kernel.run(RUN_TRAINER)
        assert [line for line in out.splitlines() if line.startswith("Training epoch")] == [
            f"Training epoch {epoch}" for epoch in range(10)
        ], out
        assert kernel.stderr == ""
        kernel.run(RNN_ONE_STEP)
        report = kernel.value("report")
        # 4 LSTM layers of 4 tensors, the embedding's weight, the decoder's two
        assert report["grads"] == 4 * 4 + 1 + 2
        assert report["nonzero"] == report["grads"]
        assert report["loss"][0] == pytest.approx(report["loss"][1], rel=1e-6)
        assert report["grads_match"], "distributed gradients differ from one process's"
        assert report["weights_match"], "DistributedOptimizer's step differs from SGD's"

    def test_then_the_rl_part_in_the_same_kernel(self, kernel):
        """The tutorial names the kernel 'agent' here: torch fixes a process's name, so
        nbrpc refuses before starting anything and says how to go on (docs/errors.md);
        without --self the kernel stays 'trainer', which the RL code never names."""
        kernel.run("%rpc_shutdown  # the end of the RNN part")
        kernel.run(STAND_IN_GYM)
        kernel.run(RL_PART)
        _, errors = kernel.execute("%rpc_init --names obs1,obs2 --self agent --quiet")
        assert len(errors) == 1, errors
        assert errors[0].startswith("ConfigError"), errors
        assert "torch fixes a process's name for its lifetime" in errors[0]
        assert "Without --self, %rpc_init keeps 'trainer'" in errors[0]
        assert "starting" not in kernel.stderr  # refused before any progress was drawn
        kernel.run("%rpc_init --names obs1,obs2 --quiet")
        kernel.run("import nbrpc")
        assert kernel.value("nbrpc.workers()") == ["trainer", "obs1", "obs2"]

        out = kernel.run(RUN_AGENT)
        # the stand-in's episodes all last EPISODE_STEPS; the tutorial's running reward
        # then crosses the threshold after this many episodes
        steps, threshold = kernel.value("[EPISODE_STEPS, REWARD_THRESHOLD]")
        running, expected = 0.0, []
        while running <= threshold:
            running = 0.05 * steps + (1 - 0.05) * running  # the tutorial's
            expected.append(f"Last reward: {steps:.2f}\tAverage reward: {running:.2f}")
        lines = [line for line in out.splitlines() if line.startswith("Episode ")]
        assert [line.split("\t", 1)[1] for line in lines] == expected, out
        assert lines[-1].startswith(f"Episode {len(expected)}\t")
        assert f"Solved! Running reward is now {running}" in out  # the same float
        assert kernel.stderr == ""

        # one more episode, looked at before finish_episode: every observer's rewards and
        # log-probabilities arrived, keyed by torch's ids (ps had 1 in this kernel)
        kernel.run("before = [p.detach().clone() for p in agent.policy.parameters()]")
        kernel.run("agent.run_episode()")
        ids = kernel.value("[rpc.get_worker_info(f'obs{i}').id for i in (1, 2)]")
        assert ids == [2, 3]
        got = kernel.value(
            "{k: [sum(r), len(agent.saved_log_probs[k])] for k, r in agent.rewards.items()}"
        )
        assert got == {str(i): [float(steps), steps] for i in ids}
        assert kernel.value("agent.finish_episode()") == steps
        # the policy learned from what the observers sent
        changed = "[not torch.equal(a, b) for a, b in zip(before, agent.policy.parameters())]"
        assert kernel.value(changed) == [True] * 4

        # CartPole's own threshold, which the stand-in never reaches: the tutorial says
        # "Ctrl+C to exit", the stop button in a notebook
        forever = RUN_AGENT.replace(
            "agent = Agent(args.world_size)\n",
            "agent = Agent(args.world_size)\nagent.reward_threshold = 475.0\n",
        )
        ran_on, errors = kernel.stop_after(forever, seconds=2)
        assert errors == ["KeyboardInterrupt: "], errors
        assert ran_on < 5, f"the cell ran {ran_on:.1f} s after the stop button"
        text = kernel.shown_error()
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # IPython colours a traceback it formats
        # the cell's lines, wherever the button landed (in fut.wait() or between calls:
        # small calls take a lane, so most of an episode is the kernel's own work now)
        assert "Cell In[" in text, text
        for hidden in ("nbrpc/", "torch/futures", "torch/distributed"):
            assert hidden not in text, text
        assert kernel.value("i_episode") > 1
        # the episode the button cut short ends on the observers: its last steps still
        # reach the agent (on a busy machine, after the next episode began and its
        # optimizer step changed the weights they were computed with). Wait until no step
        # arrived for 1 s, then the next ones run
        kernel.run(
            "import time\n"
            "def steps_seen():\n"
            "    return sum(len(v) for v in agent.saved_log_probs.values())\n"
            "seen, since = steps_seen(), time.monotonic()\n"
            "while time.monotonic() - since < 1.0:\n"
            "    time.sleep(0.1)\n"
            "    if steps_seen() != seen:\n"
            "        seen, since = steps_seen(), time.monotonic()\n"
        )
        kernel.run("agent.run_episode(); agent.finish_episode()")
        kernel.run("agent.run_episode()")
        assert kernel.value("agent.finish_episode()") == steps
        assert kernel.stderr == ""
        out = kernel.run("%rpc_shutdown")
        assert "obs1, obs2 left" in out
        assert kernel.stderr == ""  # nothing in red as the workers leave


# -- dist_pipeline_parallel_tutorial ------------------------------------------------------------

#: Steps 1 and 2 of the tutorial: ResNet50's two shards, in miniature (the same classes and
#: layers, fewer and narrower blocks, 10 classes) so that a step takes milliseconds on CPU.
PIPELINE_MODEL = """
import threading

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import RRef


# the tutorial: from torchvision.models.resnet import Bottleneck (torchvision is not
# installed here): torchvision's Bottleneck
def conv3x3(in_planes, out_planes, stride=1, groups=1, dilation=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=dilation,
                     groups=groups, bias=False, dilation=dilation)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1,
                 base_width=64, dilation=1, norm_layer=None):
        super().__init__()
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = norm_layer(width)
        self.conv2 = conv3x3(width, width, stride, groups, dilation)
        self.bn2 = norm_layer(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = norm_layer(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


num_classes = 10  # the tutorial: 1000


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class ResNetBase(nn.Module):
    def __init__(self, block, inplanes, num_classes=1000,
                groups=1, width_per_group=64, norm_layer=None):
        super(ResNetBase, self).__init__()

        self._lock = threading.Lock()
        self._block = block
        # the tutorial: nn.BatchNorm2d, whatever norm_layer says (torchvision's rule here)
        self._norm_layer = norm_layer or nn.BatchNorm2d
        self.inplanes = inplanes
        self.dilation = 1
        self.groups = groups
        self.base_width = width_per_group

    def _make_layer(self, planes, blocks, stride=1):
        norm_layer = self._norm_layer
        downsample = None
        previous_dilation = self.dilation
        if stride != 1 or self.inplanes != planes * self._block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * self._block.expansion, stride),
                norm_layer(planes * self._block.expansion),
            )

        layers = []
        layers.append(self._block(self.inplanes, planes, stride, downsample, self.groups,
                                self.base_width, previous_dilation, norm_layer))
        self.inplanes = planes * self._block.expansion
        for _ in range(1, blocks):
            layers.append(self._block(self.inplanes, planes, groups=self.groups,
                                    base_width=self.base_width, dilation=self.dilation,
                                    norm_layer=norm_layer))

        return nn.Sequential(*layers)

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


class ResNetShard1(ResNetBase):
    def __init__(self, device, *args, **kwargs):
        super(ResNetShard1, self).__init__(
            Bottleneck, 8, num_classes=num_classes, *args, **kwargs)  # the tutorial: 64

        self.device = device
        self.seq = nn.Sequential(
            nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False),
            self._norm_layer(self.inplanes),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            self._make_layer(8, 1),  # the tutorial: (64, 3)
            self._make_layer(16, 1, stride=2)  # the tutorial: (128, 4, stride=2)
        ).to(self.device)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out =  self.seq(x)
        return out.cpu()


class ResNetShard2(ResNetBase):
    def __init__(self, device, *args, **kwargs):
        super(ResNetShard2, self).__init__(
            Bottleneck, 64, num_classes=num_classes, *args, **kwargs)  # the tutorial: 512

        self.device = device
        self.seq = nn.Sequential(
            self._make_layer(32, 1, stride=2),  # the tutorial: (256, 6, stride=2)
            self._make_layer(64, 1, stride=2),  # the tutorial: (512, 3, stride=2)
            nn.AdaptiveAvgPool2d((1, 1)),
        ).to(self.device)

        self.fc =  nn.Linear(64 * self._block.expansion, num_classes).to(self.device)

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.fc(torch.flatten(self.seq(x), 1))
        return out.cpu()


class DistResNet50(nn.Module):
    def __init__(self, num_split, workers, *args, **kwargs):
        super(DistResNet50, self).__init__()

        self.num_split = num_split

        # Put the first part of the ResNet50 on workers[0]
        self.p1_rref = rpc.remote(
            workers[0],
            ResNetShard1,
            args = ("cpu",) + args,  # the tutorial: "cuda:0"; no GPU here
            kwargs = kwargs
        )

        # Put the second part of the ResNet50 on workers[1]
        self.p2_rref = rpc.remote(
            workers[1],
            ResNetShard2,
            args = ("cpu",) + args,  # the tutorial: "cuda:1"
            kwargs = kwargs
        )

    def forward(self, xs):
        out_futures = []
        # the tutorial: xs.split(self.split_size, dim=0), an attribute it never sets; its
        # num_split is the number of micro-batches per batch (its text and timings say so)
        split_size = xs.size(0) // self.num_split
        for x in iter(xs.split(split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)

        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params
"""

#: Steps 3 and 4: the training loop, and the tutorial's __main__ as a cell (mp.spawn and
#: init_rpc are %rpc_init's).
PIPELINE_TRAINING = """
import torch.distributed.autograd as dist_autograd
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

num_batches = 3
batch_size = 16  # the tutorial: 120 images of 128 x 128
image_w = 32
image_h = 32


def run_master(num_split):
    # put the two model parts on worker1 and worker2 respectively
    model = DistResNet50(num_split, ["worker1", "worker2"])
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=0.05,
    )

    one_hot_indices = torch.LongTensor(batch_size) \\
                        .random_(0, num_classes) \\
                        .view(batch_size, 1)

    for i in range(num_batches):
        print(f"Processing batch {i}")
        # generate random inputs and labels
        inputs = torch.randn(batch_size, 3, image_w, image_h)
        labels = torch.zeros(batch_size, num_classes) \\
                    .scatter_(1, one_hot_indices, 1)

        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            dist_autograd.backward(context_id, [loss_fn(outputs, labels)])
            opt.step(context_id)


import time

for num_split in [1, 2, 4, 8]:
    tik = time.time()
    run_master(num_split)
    tok = time.time()
    print(f"number of splits = {num_split}, execution time = {tok - tik}")
"""

#: The test's own cell: one step of the pipelined model against the same two shards run
#: whole in the kernel (one process, the batch unsplit, torch.optim.SGD).
PIPELINE_ONE_STEP = """
def group_norm(channels):
    return nn.GroupNorm(4, channels)


def grads_of(shard_rref, context_id):
    on_here = dist_autograd.get_gradients(context_id)
    return [on_here.get(p) for p in shard_rref.local_value().parameters()]


def weights_of(shard_rref):
    return [p.detach() for p in shard_rref.local_value().parameters()]


def one_step(num_split, norm_layer):
    torch.manual_seed(0)
    inputs = torch.randn(batch_size, 3, image_w, image_h)
    labels = torch.zeros(batch_size, num_classes).scatter_(
        1, torch.randint(0, num_classes, (batch_size, 1)), 1
    )
    loss_fn = nn.MSELoss()

    model = DistResNet50(num_split, ["worker1", "worker2"], norm_layer=norm_layer)
    shards = [ResNetShard1("cpu", norm_layer=norm_layer),
              ResNetShard2("cpu", norm_layer=norm_layer)]
    for shard, rref in zip(shards, [model.p1_rref, model.p2_rref]):
        shard.load_state_dict(rref.rpc_sync().state_dict())
    params = [p for shard in shards for p in shard.parameters()]

    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
    with dist_autograd.context() as context_id:
        outputs = model(inputs)
        loss = loss_fn(outputs, labels)
        dist_autograd.backward(context_id, [loss])
        got = []
        for rref in (model.p1_rref, model.p2_rref):
            got += rpc.rpc_sync(rref.owner(), grads_of, args=(rref, context_id))
        opt.step(context_id)
    stepped = []
    for rref in (model.p1_rref, model.p2_rref):
        stepped += rpc.rpc_sync(rref.owner(), weights_of, args=(rref,))

    one, two = shards
    local_outputs = two.fc(torch.flatten(two.seq(one.seq(inputs)), 1))
    local_loss = loss_fn(local_outputs, labels)
    local_loss.backward()
    torch.optim.SGD(params, lr=0.05).step()

    def close(a, b):
        return a is not None and torch.allclose(a, b, rtol=1e-4, atol=1e-6)

    return {
        "params": [len(got), len(params)],
        "no_grad": sum(g is None for g in got),
        "outputs": close(outputs, local_outputs),
        "max_output_diff": (outputs - local_outputs).abs().max().item(),
        "loss": [loss.item(), local_loss.item()],
        "grads": all(close(g, p.grad) for g, p in zip(got, params)),
        "weights": all(close(s, p.detach()) for s, p in zip(stepped, params)),
    }
"""


@pytest.fixture(scope="class")
def pipeline_kernel():
    with running_kernel(
        "%load_ext nbrpc",
        # the tutorial: TensorPipeRpcBackendOptions(num_worker_threads=128), master, worker1..
        "%rpc_init --names worker1,worker2 --self master --threads 128 --quiet",
        PIPELINE_MODEL,
        closing="%rpc_shutdown",
    ) as k:
        yield k


class TestPipelineTutorial:
    @pytest.fixture
    def kernel(self, pipeline_kernel):
        return pipeline_kernel

    def test_the_training_loop_runs_for_every_number_of_splits(self, kernel):
        out = kernel.run(PIPELINE_TRAINING)
        splits = [line.split(",")[0] for line in out.splitlines() if line.startswith("number")]
        assert splits == [f"number of splits = {n}" for n in (1, 2, 4, 8)], out
        assert out.count("Processing batch 2") == 4
        assert kernel.stderr == ""

    @pytest.mark.parametrize("num_split", [2, 4, 8])
    def test_a_pipelined_step_is_the_step_of_the_whole_model(self, kernel, num_split):
        if "one_step" not in kernel.value("list(globals())"):
            kernel.run(PIPELINE_TRAINING.split("import time")[0] + PIPELINE_ONE_STEP)
        report = kernel.value(f"one_step({num_split}, group_norm)")
        assert report["params"][0] == report["params"][1] > 0, report
        assert report["no_grad"] == 0, report
        assert report["outputs"], report
        assert report["loss"][0] == pytest.approx(report["loss"][1], rel=1e-5), report
        assert report["grads"], report
        assert report["weights"], report

    def test_its_cuda_shards_on_a_host_without_cuda_say_why(self, kernel):
        """The tutorial as printed puts its shards on "cuda:0" and "cuda:1": without CUDA
        the shard's constructor raises on the worker, and parameter_rrefs() (an RRef proxy
        on that shard) shows that error, its type and where it was raised."""
        import torch

        if torch.cuda.is_available():
            pytest.skip("this host has CUDA: the tutorial's cuda:0 shard may well start")
        _, errors = kernel.execute(
            'p1_rref = rpc.remote("worker1", ResNetShard1, args=("cuda:0",))\n'
            "p1_rref.remote().parameter_rrefs().to_here()"
        )
        assert errors == ["AssertionError: Torch not compiled with CUDA enabled"], errors
        text = kernel.shown_error()
        assert text.count("Remote traceback (most recent call last), on worker1:") == 1, text
        hop = text.split("on worker1:", 1)[1]
        assert "in __init__" in hop.split("\n")[1], text  # the shard's line in its cell
        assert "Cell In[" in hop.split("\n")[1], text
        for hidden in ("RuntimeError", "nbrpc #", "failures.py", "rref_proxy.py"):
            assert hidden not in text, text

    def test_the_comparison_sees_batch_norm_over_micro_batches(self, kernel):
        """The tutorial's BatchNorm normalizes each micro-batch by its own statistics: one
        micro-batch is the whole model's step, four are not (why the comparison above uses
        GroupNorm, which the tutorial's norm_layer allows once it is read)."""
        if "one_step" not in kernel.value("list(globals())"):
            kernel.run(PIPELINE_TRAINING.split("import time")[0] + PIPELINE_ONE_STEP)
        whole = kernel.value("one_step(1, None)")
        assert whole["outputs"], whole
        assert whole["grads"], whole
        assert whole["weights"], whole
        split = kernel.value("one_step(4, None)")
        assert not split["outputs"], split
        assert split["max_output_diff"] > 1e-3, split
