"""What each global torch hook would cost a training step, as a sign of life for hang detection.

Hang detection learns its bound from the steps a worker makes; a phase without optimizer
steps (an evaluation, a checkpoint) must not look hung. Every sign of life a worker reports
through a hook is paid on every step, so each candidate is measured here before it is used.
The budget: all hooks together under 0.1% of a 10 ms step (10 us).

Candidates, each timed with and without the hook installed (blocks interleaved, the
fastest block of each, as ``timeit`` does: a slower block measured the machine's load):

* ``optimizer``: torch's global optimizer step post hook calling ``progress()`` (what the
  worker bootstrap installs), per ``optimizer.step()``; also the hook called directly.
* ``forward-pre``, ``forward``: a global module forward (pre) hook
  (``torch.nn.modules.module.register_module_forward_pre_hook`` / ``..._forward_hook``), per
  module call (an ``nn.Identity``, so the hook's own cost shows), then per training step of
  a small MLP and of a 4-layer transformer encoder (its forward and backward).
* ``backward``: a global full backward hook (``register_module_full_backward_hook``), per
  training step of the same models.

torch offers no global hook on collectives (2.13: ``ProcessGroup`` has no hook registration
for gloo; DDP's ``register_comm_hook`` is per model and replaces its all-reduce) and none on
the autograd engine as a whole (``register_multi_grad_hook`` and ``Node.register_hook`` take
given tensors or nodes); they are not measured.

Run: ``python benchmarks/hook_cost.py [--blocks 60] [--calls 20000] [--steps 40]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aelastic.agent.health.activity import sample
from aelastic.agent.health.progress import ProgressPages

#: The budget: all hooks together, per step (microseconds): 0.1% of a 10 ms step.
BUDGET_US = 10.0


def _fastest(
    blocks: int,
    per_block: int,
    plain: Callable[[], object],
    hooked: Callable[[], object],
    install: Callable[[], Any],
) -> tuple[float, float]:
    """(without, with) microseconds per call: blocks interleaved, the fastest of each."""

    def timed(call: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(per_block):
            call()
        return (time.perf_counter() - t0) / per_block * 1e6

    without, with_hook = [], []
    for _ in range(blocks):
        without.append(timed(plain))
        handle = install()
        try:
            with_hook.append(timed(hooked))
        finally:
            handle.remove()
    return min(without), min(with_hook)


class _Counter:
    """A forward pre-hook that counts module calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: object, inputs: object) -> None:
        self.calls += 1


def _models() -> dict[str, tuple[Any, Any, int]]:
    """name -> (model, input, module calls per forward)."""
    import torch

    mlp = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())]
    )
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    models = {
        "MLP (8 layers)": (mlp, torch.randn(32, 64)),
        "transformer (4 layers)": (encoder, torch.randn(8, 16, 64)),
    }
    result = {}
    for name, (model, x) in models.items():
        counter = _Counter()
        handle = torch.nn.modules.module.register_module_forward_pre_hook(counter)
        model(x)
        handle.remove()
        result[name] = (model, x, counter.calls)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=60)
    parser.add_argument("--calls", type=int, default=20000, help="calls per block (micro)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per block")
    args = parser.parse_args(argv)

    import warnings

    import torch
    from torch.nn.modules import module as nn_module

    warnings.filterwarnings("ignore", "Full backward hook")  # inputs without gradients
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.set_num_threads(1)
    pages = ProgressPages(1)
    os.environ.update(pages.env(0))
    try:
        from aelastic.worker._site import _aelastic_worker as runtime

        runtime.progress()  # attach once (maps the page, arms the stacks signal)
        progress = runtime.progress
        print(
            f"global hooks as signs of life ({os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"one thread; fastest of {args.blocks} interleaved blocks)"
        )
        print(f"budget: all hooks together under {BUDGET_US:g} us a step (0.1% of 10 ms)\n")

        # The optimizer step hook (in use).
        model = torch.nn.Linear(16, 16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        hook = runtime._on_optimizer_step
        per = args.calls // 20
        direct = float("inf")
        for _ in range(args.blocks):
            t0 = time.perf_counter()
            for _ in range(per):
                hook(optimizer, (), {})
            direct = min(direct, (time.perf_counter() - t0) / per * 1e6)
        plain, hooked = _fastest(
            args.blocks,
            args.calls // 20,
            optimizer.step,
            optimizer.step,
            lambda: register_optimizer_step_post_hook(hook),
        )
        print("optimizer step post hook (progress(): steps, time and the step's gap in the page)")
        print(f"  the hook called directly (the whole cost): {direct:7.3f} us")
        print(
            f"  optimizer.step() of Linear(16, 16):    {plain:7.2f} us without, {hooked:7.2f} "
            f"with ({hooked - plain:+.2f} us)\n"
        )

        # Global module hooks, per module call.
        ident, x = torch.nn.Identity(), torch.zeros(1)

        def on_pre(module: object, inputs: object) -> None:
            progress()

        def on_forward(module: object, inputs: object, output: object) -> None:
            progress()

        def on_backward(module: object, grad_in: object, grad_out: object) -> None:
            progress()

        installs: dict[str, Callable[[], Any]] = {
            "forward-pre": lambda: nn_module.register_module_forward_pre_hook(on_pre),
            "forward": lambda: nn_module.register_module_forward_hook(on_forward),
            "backward": lambda: nn_module.register_module_full_backward_hook(on_backward),
        }
        print("global module hooks, per call of an nn.Identity:")
        for name in ("forward-pre", "forward"):
            plain, hooked = _fastest(
                args.blocks, args.calls // 20, lambda: ident(x), lambda: ident(x), installs[name]
            )
            print(
                f"  {name:12} {plain:7.2f} us without, {hooked:7.2f} with "
                f"({hooked - plain:+.2f} us a module call)"
            )
        print()
        print("per training step (forward, backward, SGD step; the optimizer hook off):")
        for label, (net, inp, calls) in _models().items():
            opt = torch.optim.SGD(net.parameters(), lr=0.001)

            def step(net: Any = net, inp: Any = inp, opt: Any = opt) -> None:
                net(inp).sum().backward()
                opt.step()
                opt.zero_grad()

            for _ in range(5):
                step()
            print(f"  {label}: {calls} module calls a forward")
            for name in ("forward-pre", "forward", "backward"):
                plain, hooked = _fastest(args.blocks, args.steps, step, step, installs[name])
                extra = hooked - plain
                share = extra / 10_000 * 100
                print(
                    f"    {name:12} {plain:8.1f} us a step without, {hooked:8.1f} with "
                    f"({extra:+7.1f} us: {share:.2f}% of a 10 ms step)"
                )
        print()
        looks = 200
        t0 = time.perf_counter()
        for _ in range(looks):
            sample(os.getpid())
        look = (time.perf_counter() - t0) / looks * 1e6
        print("in use: the optimizer step post hook alone")
        print(
            f"  {direct:.3f} us a step = {direct / BUDGET_US * 0.1:.4f}% of a 10 ms step "
            f"(budget 0.1%): {'met' if direct < BUDGET_US else 'NOT met'}"
        )
        print(
            f"  the agent's look from outside (/proc of this process): {look:.0f} us a look, in "
            "the agent, only past half a bound without a step: nothing a step"
        )
    finally:
        pages.close()
        del os.environ["AELASTIC_PROGRESS_FILE"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
