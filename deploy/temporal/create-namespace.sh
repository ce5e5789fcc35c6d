#!/bin/sh
# One-shot (temporalio/admin-tools): create llm-batch's namespace and register the
# custom search attributes jobs set (see llmbatch/search_attributes.py), so operators
# can filter jobs in the Web UI. Safe to run again.
set -eu

: "${TEMPORAL_ADDRESS:?}" "${NAMESPACE:?}" "${SEARCH_ATTRIBUTES:?}"
RETENTION="${NAMESPACE_RETENTION:-7d}"

until temporal operator cluster health --address "$TEMPORAL_ADDRESS"; do
    echo "waiting for Temporal at $TEMPORAL_ADDRESS"
    sleep 2
done

temporal operator namespace describe --namespace "$NAMESPACE" --address "$TEMPORAL_ADDRESS" \
    >/dev/null 2>&1 ||
    temporal operator namespace create --namespace "$NAMESPACE" --retention "$RETENTION" \
        --address "$TEMPORAL_ADDRESS"

# A new namespace takes a few seconds to reach every part of the server.
tries=0
until existing=$(temporal operator search-attribute list --namespace "$NAMESPACE" \
    --address "$TEMPORAL_ADDRESS" 2>&1); do
    tries=$((tries + 1))
    if [ "$tries" -ge 60 ]; then
        echo "namespace $NAMESPACE is not ready: $existing"
        exit 1
    fi
    sleep 2
done
# SEARCH_ATTRIBUTES: space-separated NAME=Type pairs, e.g. "JobId=Keyword ItemsDone=Int".
for pair in $SEARCH_ATTRIBUTES; do
    name=${pair%%=*}
    type=${pair#*=}
    if echo "$existing" | grep -qw "$name"; then
        echo "search attribute $name exists"
    else
        temporal operator search-attribute create --namespace "$NAMESPACE" \
            --name "$name" --type "$type" --address "$TEMPORAL_ADDRESS"
    fi
done
echo "namespace $NAMESPACE is ready"
