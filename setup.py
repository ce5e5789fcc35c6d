"""One import name, ``llmbatch``, for everything the wheel installs.

The design card keeps ``workflows/``, ``activities/``, ``workers/`` and ``migrations/``
at the top of the repository; they install as ``llmbatch.workflows``,
``llmbatch.activities``, ``llmbatch.workers`` and ``llmbatch.migrations``, so a user's
own ``workflows`` or ``workers`` package never collides with ours. The rest of the
metadata is in pyproject.toml; this file exists only because ``packages.find`` there
cannot map a folder to another package name.

``llmbatch/<name>`` is a link to ``../<name>`` so that a checkout imports, and mypy
checks, the same module names the wheel installs; the build maps the real folders and
never walks the links.
"""

from setuptools import find_packages, setup

MAPPED = ("workflows", "activities", "workers", "migrations")

setup(
    packages=[
        *find_packages(
            include=["llmbatch", "llmbatch.*"], exclude=[f"llmbatch.{m}" for m in MAPPED]
        ),
        *(f"llmbatch.{m}" for m in MAPPED),
    ],
    package_dir={f"llmbatch.{m}": m for m in MAPPED},
)
