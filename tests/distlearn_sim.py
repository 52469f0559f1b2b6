"""Single-process references for the distlearn tests: the data and models the workers
use, and plain simulations of N replicas running the same formulas."""

from __future__ import annotations

import torch
from torch import nn


def make_model(seed: int, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(5, 8)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(8))
    layers += [nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 5, generator=g), torch.randint(0, 3, (size,), generator=g)


class MomentumSGD:
    """SGD with momentum, written out: torch.optim's first use imports torch._dynamo,
    seconds of CPU in every test process, and these tests are about the gradients."""

    def __init__(self, model: nn.Module, lr: float = 0.1, momentum: float = 0.9):
        self.params = list(model.parameters())
        self.bufs = [torch.zeros_like(p) for p in self.params]
        self.lr, self.momentum = lr, momentum

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.params, self.bufs, strict=True):
            if p.grad is None:  # frozen, like torch.optim.SGD
                continue
            buf.mul_(self.momentum).add_(p.grad)
            p.sub_(self.lr * buf)


def sgd_reference(steps: int, size: int) -> dict:
    """One process on the whole batch, from the root's initial weights."""
    model = make_model(seed=100)
    opt = MomentumSGD(model)
    for step in range(steps):
        x, y = batch(step, size)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def uneven_grad(epoch: int, node: int, step: int, steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(epoch * 10_000 + node * 100 + step)
    return torch.randn(7, dtype=torch.float64, generator=g) / steps


def uneven_reference(steps_table: list[list[int]]) -> list[torch.Tensor]:
    """Parameters after each synchronisation: node 0's at the start, then those of the
    node with the most steps, where step k averaged the gradients of the nodes that
    were still running at k."""
    params = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = [params.clone()]
    for epoch, steps in enumerate(steps_table):
        for k in range(max(steps)):
            active = [n for n, s in enumerate(steps) if s > k]
            total = sum(uneven_grad(epoch, n, k, steps[n]) for n in active)
            params = params + total / len(active)
        out.append(params.clone())
    return out


def uneven_momentum_reference(steps_table: list[list[int]], lr: float, momentum: float):
    """SGD with momentum in one process over the mean gradient of the nodes still
    running at each step (the path of the node with the most steps): the parameters
    after every step, per epoch, and the final momentum buffer."""
    params = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    buf = torch.zeros_like(params)
    out = []
    for epoch, steps in enumerate(steps_table):
        mine = []
        for k in range(max(steps)):
            active = [n for n, s in enumerate(steps) if s > k]
            g = sum(uneven_grad(epoch, n, k, steps[n]) for n in active) / len(active)
            buf = buf * momentum + g
            params = params - lr * buf
            mine.append(params.clone())
        out.append(mine)
    return out, buf


def ea_init(seed: int) -> torch.Tensor:
    return torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def ea_noise(epoch: int, node: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7_000_000 + epoch * 10_000 + node * 100 + step)
    return {
        "w": torch.randn(6, dtype=torch.float64, generator=g),
        "b": torch.randn(2, dtype=torch.float64, generator=g),
    }


def ea_reference(num_nodes: int, steps_table: list[list[int]], tau: int, alpha: float) -> dict:
    """N replicas of elastic averaging in one process, rounds in lock step.

    Within an epoch node n averages after each of its steps that is a multiple of tau;
    at the end of the epoch nodes with fewer averages keep averaging (without stepping)
    until every node has arrived, plus one final round all together; then the center is
    the root's. Returns each node's parameters before `synchronize_center` and the center
    after it, per epoch.
    """
    root = {"w": ea_init(0), "b": ea_init(1000)[:2]}
    params = [{k: v.clone() for k, v in root.items()} for _ in range(num_nodes)]
    center = {k: v.clone() for k, v in root.items()}
    trajectory, centers = [], []

    def average(nodes: list[int]) -> None:
        # Every node computes its delta and moves; the center moves by the sum.
        total = {k: torch.zeros_like(v) for k, v in center.items()}
        for n in nodes:
            for k in center:
                delta = alpha * (params[n][k] - center[k])
                params[n][k] = params[n][k] - delta
                total[k] = total[k] + delta
        for k in center:
            center[k] = center[k] + total[k]

    for epoch, steps in enumerate(steps_table):
        rounds = [s // tau for s in steps]
        snapshots = [None] * num_nodes
        for rnd in range(max(rounds)):
            # Active nodes take their tau steps, then everyone averages once.
            for n in range(num_nodes):
                if rnd < rounds[n]:
                    for step in range(rnd * tau, (rnd + 1) * tau):
                        noise = ea_noise(epoch, n, step)
                        for k in params[n]:
                            params[n][k] = params[n][k] + noise[k]
            for n in range(num_nodes):
                # A node that ran out of averages this epoch still has steps past the
                # last multiple of tau before it reaches synchronize_center.
                if rnd == rounds[n] and snapshots[n] is None:
                    _finish_epoch(params[n], epoch, n, rnd * tau, steps[n])
                    snapshots[n] = {k: v.clone() for k, v in params[n].items()}
            average(list(range(num_nodes)))
        for n in range(num_nodes):
            if snapshots[n] is None:
                _finish_epoch(params[n], epoch, n, rounds[n] * tau, steps[n])
                snapshots[n] = {k: v.clone() for k, v in params[n].items()}
        average(list(range(num_nodes)))  # the round in which everyone is finished
        trajectory.append(snapshots)
        centers.append({k: v.clone() for k, v in center.items()})
    return {"params": trajectory, "centers": centers}


def _finish_epoch(p: dict, epoch: int, node: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        noise = ea_noise(epoch, node, step)
        for k in p:
            p[k] = p[k] + noise[k]


# -- AllReduceSGD with buckets overlapped with backward ----------------------------------


def make_deep_model(seed: int) -> nn.Module:
    """Eight parameters: with tiny buckets, several buckets start during backward."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3),
    )  # fmt: skip


class ComplexNet(nn.Module):
    """A complex parameter (a per-feature phase and gain) before a real head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.w = nn.Parameter(torch.randn(5, dtype=torch.complex64))
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x * self.w).abs())


def complex_reference(steps: int, size: int) -> dict:
    """One process on the whole batch, plain SGD (lr 0.1), from seed 100's weights."""
    model = ComplexNet(seed=100)
    for step in range(steps):
        x, y = batch(step, size)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
    return model.state_dict()


class Branchy(nn.Module):
    """A trunk and two heads; head `b` joins only when a step asks for it, so its
    parameters go unused on some nodes or on all of them."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.a = nn.Linear(16, 3)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.trunk(x)
        return self.a(h) + self.b(h) if use_b else self.a(h)


def branchy_uses_b(step: int, node: int) -> bool:
    """Everyone, nobody, node 0 only, nobody: a parameter unused on all nodes must keep
    `.grad = None` (the optimizer skips it); one used on some gets the mean."""
    return (True, False, node == 0, False)[step % 4]


def deep_reference(
    steps: int, size: int, frozen: dict[int, list[int]] | None = None, late: bool = False
) -> dict:
    """One process on the whole batch (mean loss), from seed 100's weights; `frozen` maps
    a step to the indices of the parameters that do not train from that step on (`late`:
    frozen after that step's backward, so the optimizer still steps on their `.grad`)."""
    model = make_deep_model(seed=100)
    opt = MomentumSGD(model)

    def freeze(step):
        if frozen and step in frozen:
            for i, p in enumerate(model.parameters()):
                p.requires_grad_(i not in frozen[step])

    for step in range(steps):
        if not late:
            freeze(step)
        x, y = batch(step, size)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if late:
            freeze(step)
        opt.step()
    return model.state_dict()


class Coefficients(nn.Module):
    """Parameters whose gradient is known in advance: loss = sum of (p_j * c_j).sum() over
    the parameters a step uses, so grad p_j = c_j, or nothing for an unused one."""

    SHAPES = ((7,), (3, 4), (5,), (2, 2, 2), (6,))

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList(
            nn.Parameter(torch.randn(s, dtype=torch.float64, generator=g)) for s in self.SHAPES
        )

    def forward(self, coefficients: dict[int, torch.Tensor]) -> torch.Tensor:
        return sum((self.ps[j] * c).sum() for j, c in coefficients.items())


def coefficients(epoch: int, node: int, step: int, frozen: list[int]) -> dict[int, torch.Tensor]:
    """The gradient of each parameter that node `node` uses at `step` (some it skips)."""
    g = torch.Generator().manual_seed(9_000_000 + epoch * 10_000 + node * 100 + step)
    out = {}
    for j, shape in enumerate(Coefficients.SHAPES):
        c = torch.randn(shape, dtype=torch.float64, generator=g)
        if (node + step + j) % 3 != 0 and j not in frozen:
            out[j] = c
    return out


def coefficients_reference(table: list[list[int]], frozen: list[list[int]]) -> list[list]:
    """Parameters after each synchronisation: the root's at the start; then step k moves
    every trainable parameter by minus the mean over the nodes still running at k of
    their coefficient (zero where a node did not use the parameter)."""
    params = [p.detach().clone() for p in Coefficients(seed=0).ps]
    out = [[p.clone() for p in params]]
    for epoch, steps in enumerate(table):
        for k in range(max(steps)):
            active = [n for n, s in enumerate(steps) if s > k]
            for j in range(len(params)):
                if j in frozen[epoch]:
                    continue
                used = [coefficients(epoch, n, k, frozen[epoch]).get(j) for n in active]
                total = sum(c for c in used if c is not None)
                if isinstance(total, torch.Tensor):
                    params[j] = params[j] - total / len(active)
        out.append([p.clone() for p in params])
    return out
