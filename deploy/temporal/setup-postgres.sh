#!/bin/sh
# One-shot (temporalio/admin-tools): create Temporal's two databases on temporal-db and
# bring their schemas up to the server's version. Safe to run again: "create" fails
# harmlessly on an existing database and update-schema only applies what is missing.
set -eu

: "${POSTGRES_SEEDS:?}" "${DB_PORT:?}" "${POSTGRES_USER:?}" "${SQL_PASSWORD:?}"
SCHEMA_DIR=/etc/temporal/schema/postgresql/v12

echo "waiting for Postgres at ${POSTGRES_SEEDS}:${DB_PORT}"
until nc -z "$POSTGRES_SEEDS" "$DB_PORT"; do sleep 1; done

for db in temporal temporal_visibility; do
    tool() {
        temporal-sql-tool --plugin postgres12 --ep "$POSTGRES_SEEDS" -p "$DB_PORT" \
            -u "$POSTGRES_USER" --db "$db" "$@"
    }
    schema=temporal
    [ "$db" = temporal_visibility ] && schema=visibility
    tool create || echo "database $db exists"
    tool setup-schema -v 0.0 || echo "schema of $db is set up"
    tool update-schema -d "$SCHEMA_DIR/$schema/versioned"
done
echo "Temporal schemas are up to date"
