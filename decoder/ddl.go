package decoder

// OutboxDDL creates the default outbox table, the one DefaultColumns names
// (the README's DDL; cmd/jetbox's README test keeps them equal). The demo,
// the tests and the benchmark create it.
const OutboxDDL = `CREATE TABLE public.outbox (
  id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
  aggregate_type text        NOT NULL,
  aggregate_id   text        NOT NULL,
  event_type     text        NOT NULL,
  payload        jsonb       NOT NULL,
  headers        jsonb,
  created_at     timestamptz NOT NULL DEFAULT now()
)`
