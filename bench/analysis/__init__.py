"""bench.analysis: the PySpark job that reads benchmark logs (`bench/LOGS.md`) and writes tables,
charts and a report.

    python -m bench.analysis [INPUT] [--out DIR] [--master local[*]]

Modules: `cli` (arguments; `main(argv)`), `job` (the Spark session and every computation over the logs), `report` (CSV, Markdown,
HTML and PNG from the small result tables; no Spark), `synth` (seeded synthetic runs).
PySpark is imported only by `job`, so the rest of `bench` works without it.
"""
