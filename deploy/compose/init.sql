-- Run once by the postgres image on first start (docker-entrypoint-initdb.d).
-- The outbox contract jetbox reads by default (see README, "The outbox table").
CREATE TABLE public.outbox (
  id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
  aggregate_type text        NOT NULL,
  aggregate_id   text        NOT NULL,
  event_type     text        NOT NULL,
  payload        jsonb       NOT NULL,
  headers        jsonb,
  created_at     timestamptz NOT NULL DEFAULT now()
);

-- A business table for the sample producer.
CREATE TABLE public.orders (
  id       bigserial   PRIMARY KEY,
  customer text        NOT NULL,
  total    numeric     NOT NULL,
  placed   timestamptz NOT NULL DEFAULT now()
);
