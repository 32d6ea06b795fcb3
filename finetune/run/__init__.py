"""The run's skeleton, the straight line: preflight and build in named stages (`build`), the loop that only steps
(`loop`), train (`train`), the setup lines and rank reports (`report`), metrics and trackers (`metrics`), the
profiler (`profile`), optimizer and schedule (`optim`), and the offline demo (`demo`).

May import: `plan`, `export`, `objectives`, `rollouts`, `model`, `storage`, `data`, `engine`, `config`, `errors`.
"""
