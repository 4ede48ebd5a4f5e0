"""REINFORCE on a small hand-written environment (no gym).

A corridor: the agent starts at the left end and is rewarded for reaching the right end
quickly. A policy network returns action probabilities; actions are sampled from
``Categorical``, their log-probabilities saved on the policy, the discounted returns
normalised, and the loss is ``-log_prob * return`` summed over the episode; one Adam step per
episode; a running reward printed every few episodes.

FIELD_FAULT=lr: from episode 15 on, the learning rate is 1000 times too large.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

FAULT = os.environ.get("FIELD_FAULT", "")
eps = 1e-6


class Corridor:
    """States 0..length-1; action 0 moves left, 1 moves right; the episode ends at the right
    end (+1) or after ``max_steps`` moves; every move costs 0.01."""

    def __init__(self, length=4, max_steps=15):
        self.length, self.max_steps = length, max_steps

    def reset(self):
        self.pos, self.t = 0, 0
        return self.observation()

    def observation(self):
        return F.one_hot(torch.tensor(self.pos), self.length).float()

    def step(self, action):
        self.pos = max(0, min(self.length - 1, self.pos + (1 if action == 1 else -1)))
        self.t += 1
        done = self.pos == self.length - 1 or self.t >= self.max_steps
        reward = 1.0 if self.pos == self.length - 1 else -0.01
        return self.observation(), reward, done


class Policy(nn.Module):
    def __init__(self, n_states, n_actions=2):
        super().__init__()
        self.affine1 = nn.Linear(n_states, 32)
        self.dropout = nn.Dropout(p=0.1)
        self.affine2 = nn.Linear(32, n_actions)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=-1)


def select_action(policy, state):
    m = Categorical(policy(state))
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def finish_episode(policy, optimizer, gamma=0.95):
    R, returns = 0.0, []
    for r in reversed(policy.rewards):
        R = r + gamma * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    policy_loss = [
        -log_prob * R for log_prob, R in zip(policy.saved_log_probs, returns, strict=True)
    ]
    optimizer.zero_grad()
    loss = torch.cat([p.view(1) for p in policy_loss]).sum()
    loss.backward()
    optimizer.step()
    del policy.rewards[:], policy.saved_log_probs[:]
    return loss.item()


def main():
    torch.manual_seed(543)
    env = Corridor()
    policy = Policy(env.length)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    running_reward = -0.2
    for episode in range(40):
        if FAULT == "lr" and episode == 15:
            for group in optimizer.param_groups:
                group["lr"] *= 1000  # <- fault
        state, ep_reward = env.reset(), 0.0
        done = False
        while not done:
            action = select_action(policy, state)
            state, reward, done = env.step(action)
            policy.rewards.append(reward)
            ep_reward += reward
        running_reward = 0.05 * ep_reward + 0.95 * running_reward
        loss = finish_episode(policy, optimizer)
        if episode % 5 == 0:
            print(
                f"episode {episode}: last reward {ep_reward:.2f}, "
                f"running reward {running_reward:.3f}, loss {loss:.3f}"
            )


if __name__ == "__main__":
    main()
