"""Run a plan inside autograd: `apply_plan(model, plan)` returns a drop-in module.

- `module`: `PlannedModule` and `apply_plan` (the plan bound by `core.bind` first);
- `interpreter`: the plan compiled into the instruction loop, and the autograd Function
  that walks it (forward part in `forward`, the rest in `backward`);
- `transfers`: an offloading plan's host pool and copies (`offload`, `prefetch`).
Running one traced ATen node is `core.interpret`'s (shared with cost measurement); the
native runtime is `core.native.runtime`. The package imports nothing itself: the native
runtime uses `transfers`, and `module` dispatches to the native runtime.
"""
