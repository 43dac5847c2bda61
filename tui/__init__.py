"""`trainguard top`: the Textual terminal dashboard.

Layout: ``app.py`` (factory ``create_app(source)`` and ``run_dashboard(args)``), ``source.py`` (the
``DataSource`` protocol and ``ApiDataSource`` over the control API), ``model.py`` (pure view
models), ``screens/`` (main screen, dialogs), ``widgets/`` (one panel per module),
``dashboard.tcss`` (the one stylesheet), ``fake.py`` (a fixed scene for tests and demos:
``python -m trainguard.tui.fake``).

What the panels read from ``GET /v1/status`` besides today's keys, shown as "n/a" until present:

* rank telemetry ``straggler_score`` (float in [0, 1]) and ``straggler_cause`` (str);
* ``gpus``: a list (or dict by index) of readings with the ``GpuReading`` field names
  (``utilization_gpu_pct``, ``memory_used_bytes``, ``memory_total_bytes``, ``temperature_c``,
  ``power_w``, ``power_limit_w``, ``ecc_uncorrected``), plus ``throttle_reasons`` (list of str),
  ``xids`` (count) and ``last_xid``;
* ``kernel``: ``{histogram name: {series: {"slots": [32 log2-µs counts], "sum_ns": int}}}``,
  e.g. ``{"runq_latency": {"node": ..., "job/rank": ...}, "block_io_latency": {"nvme0n1": ...}}``.

``GET /v1/checkpoints`` rows (``tier, job, step, size, created``) or status-style rows
(``newest_step, age_seconds, size_bytes, last_write``) fill the checkpoints panel.
"""
