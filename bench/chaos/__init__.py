"""The chaos (fault) campaign: a pure total-queue checker over a history (`checker`), seeded
fault schedules (`schedule`), network namespaces for real partitions (`netns`), the real-process
driver that runs a schedule and writes its logs (`real`), and the same schedules carried out on
the deterministic simulation (`sim`)."""
