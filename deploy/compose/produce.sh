#!/bin/sh
# Sample producer: one order per second, business row and outbox row in one transaction.
set -eu
i=0
while true; do
  i=$((i + 1))
  psql -v ON_ERROR_STOP=1 -q <<SQL
BEGIN;
WITH o AS (INSERT INTO orders (customer, total) VALUES ('customer-$i', $i * 1.5) RETURNING id, customer, total)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', o.id::text, 'OrderPlaced', jsonb_build_object('order_id', o.id, 'customer', o.customer, 'total', o.total) FROM o;
COMMIT;
SQL
  sleep 1
done
