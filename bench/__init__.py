"""bench: workloads, the load runner and (later) the Spark analysis. Uses only the client API
and the CLI, like a user."""
