"""Starting specserve's processes on one machine.

`up` starts a whole local service (`specserve up`), `local_redis` a private Redis for it and for
the tests, and `lifetime` makes every child exit with the process that started it.
"""
