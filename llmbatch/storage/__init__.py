"""One interface over the object store (S3 and compatibles) and the local disk.

URIs are ``s3://bucket/key``, ``file:///abs/path`` or plain paths (relative or
absolute). Keys and paths are taken literally: no percent-decoding, in either scheme.

Listing (:meth:`ObjectStore.list`) takes three kinds of URI:

- a glob (``*``, ``?``, ``[...]``; ``**`` for any depth): the objects it matches.
  ``*`` stops at ``/`` in both schemes, like a shell.
- a folder (``s3://b/data/`` or ``s3://b/data``, a local directory): every object
  under it, at any depth, except hidden ones: names starting with ``.`` or ``_``
  (``_SUCCESS`` markers, temporary files), as Hadoop, Spark and Arrow skip them.
- one object: itself.

Writes are atomic per object (an S3 PUT is; local files are written beside the
target and renamed over it), so a retried write replaces and never truncates.

Errors that retrying cannot fix (bad URI, no such object or bucket, access denied)
raise :class:`StorageError` subclasses with a clear message; anything else from
botocore (5xx, throttling, lost connections) propagates unchanged, after botocore's
own retries, so Temporal retries the activity.

The package: ``base`` (the :class:`~llmbatch.storage.base.ObjectStore` protocol, its
errors, ``join``), ``globbing``, ``s3``, ``local``, and ``stores`` (which store serves a
URI). May import: ``llmbatch.config``, ``llmbatch.contract`` and boto3; nothing else of
llmbatch. Callers write ``from llmbatch import storage`` and name the part they use
(``storage.stores.open_store``, ``storage.s3.S3Store``).
"""

from llmbatch.storage import base, globbing, local, s3, stores

__all__ = ["base", "globbing", "local", "s3", "stores"]
