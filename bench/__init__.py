"""bench: what a user runs to measure warren, against RabbitMQ and alone: the workload suites and
their load generators, the load runner and its logs, the chaos campaign and its explorer on the
simulation, and the Spark analysis."""
