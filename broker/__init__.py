"""broker: the node. Trio tasks own sockets, timers and the loop; they feed events into
`mirroring/` and carry out what it returns. Also the CLI (`warrenctl`), the server entry point
(`warren-server`) and the client library (`broker.client`)."""
