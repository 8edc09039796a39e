"""The optimizer: Adam as lm-human-preferences runs it (TensorFlow's epsilon placement), fused
where torch has a kernel for the tensors."""

from __future__ import annotations

import math

import torch


class TensorFlowAdam(torch.optim.Adam):
    r"""Adam as TensorFlow (and so lm-human-preferences) computes it: epsilon is added to sqrt(v)
    *before* the bias correction.

    .. math::
        \text{TF:}\quad \theta \mathrel{-}=
            \eta\,\frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\,\frac{m_t}{\sqrt{v_t} + \epsilon}
        \qquad
        \text{torch:}\quad \theta \mathrel{-}=
            \frac{\eta}{1-\beta_1^t}\,\frac{m_t}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon'}

    The two are the same update when :math:`\epsilon' = \epsilon / \sqrt{1-\beta_2^t}` (31.6 epsilon at
    step 1 with beta2 = 0.999, 1.26 epsilon at step 1000), so each step sets the group's epsilon
    to that value and lets torch's own (fused) kernel do the rest.
    """

    def __init__(self, params, lr: float, eps: float, **kwargs):
        super().__init__(params, lr=lr, eps=eps, **kwargs)
        for group in self.param_groups:
            group["tensorflow_eps"] = eps

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            started = [self.state[p]["step"] for p in group["params"] if p.grad is not None and "step" in self.state[p]]
            t = float(started[0]) + 1 if started else 1.0  # the step count this update will use
            group["eps"] = group["tensorflow_eps"] / math.sqrt(1.0 - group["betas"][1] ** t)
        return super().step(closure)


def adam(params, lr: float, eps: float, tensorflow: bool = True) -> torch.optim.Adam:
    """Adam (TensorFlow-style epsilon unless ``tensorflow`` is false), with the fused kernel where
    torch has one for these tensors (CPU and CUDA fp32/bf16).

    Why fused: on a CPU the default multi-tensor step of a 135M-parameter model takes several times
    the fused one's time, and PPO takes ``ppo_epochs * nminibatches`` steps per update.
    """
    params = list(params)
    cls = TensorFlowAdam if tensorflow else torch.optim.Adam
    try:
        return cls(params, lr=lr, eps=eps, fused=True)
    except (RuntimeError, TypeError):  # a device or dtype without a fused kernel
        return cls(params, lr=lr, eps=eps)
