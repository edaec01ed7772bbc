"""Benchmarks of Remat Studio against PyTorch's own ways to save memory (`remat bench`).

Application code over `core`, installed with the package; its optional needs (matplotlib for
the PNG chart, playwright for `--app`, transformers for the zoo of `--solvers`) come with the
`bench` extra: `pip install '.[bench]'`.

- compare: real training steps, side by side with torch.utils.checkpoint and torch.compile
  (its command line and per-model phases); strategies: the step functions it compares;
  measure: gradients, peaks and paired times of one step
- compiled: `--compiled`, our native plan compiled with inductor against compiled eager at
  the activation_memory_budget of the same measured peak
- report: the results as tables, Markdown, CSV, a PNG and an HTML chart
- runtime: the runtime's overhead over eager, and the calibration of measured op costs
- solvers: solver quality and speed, on the sample models and the Hugging Face zoo
- app: the app's latency in a headless browser
"""


class MissingExtra(ImportError):
    """An optional dependency of a benchmark is not installed; the message names the extra."""
