"""The ledger's SQL migrations, ``NNNN_name.sql``, shipped in the wheel as package data.

This folder stays at the top of the repository, where people look for it, and is a
package only so that an installed llm-batch finds its files the same way wherever it
was installed (``importlib.resources.files("llmbatch.migrations")``, see
:func:`llmbatch.ledger.migrate.packaged_migrations`); nothing imports code from here.
"""
