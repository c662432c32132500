"""The chaos (fault) campaign of issue 10: a pure total-queue checker over a history
(`checker`), seeded fault schedules (`schedule`), network namespaces for real partitions
(`netns`), and the real-process driver that runs a schedule and writes its logs (`real`)."""
