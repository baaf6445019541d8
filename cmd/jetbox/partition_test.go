package main

import (
	"bytes"
	"strings"
	"testing"
)

// TestPartitionedOutboxUserPublication: a partitioned outbox in a
// publication made without publish_via_partition_root is a member whose
// leaf partitions pg_publication_tables lists instead. check refuses it
// with the fix Postgres takes (SET publish_via_partition_root), not ADD
// TABLE, which Postgres refuses for a member; with the fix applied, it
// passes.
func TestPartitionedOutboxUserPublication(t *testing.T) {
	f := newFixture(t, withDDL(`CREATE TABLE public.outbox (id uuid NOT NULL DEFAULT gen_random_uuid(), aggregate_type text NOT NULL,
		aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL, headers jsonb,
		created_at timestamptz NOT NULL DEFAULT now()) PARTITION BY RANGE (created_at);
		CREATE TABLE public.outbox_all PARTITION OF public.outbox DEFAULT`))
	f.pg.Exec(t, "CREATE PUBLICATION jetbox FOR TABLE outbox WITH (publish = 'insert')")
	var out, errOut bytes.Buffer
	args := []string{"check", "--postgres-url=" + f.pg.DSN, "--nats-url=" + f.nats.URL}
	code := realMain(args, &out, &errOut)
	text := out.String()
	if code != exitConfig || !strings.Contains(text, "without publish_via_partition_root") ||
		!strings.Contains(text, `ALTER PUBLICATION "jetbox" SET (publish_via_partition_root = true)`) || strings.Contains(text, "ADD TABLE") {
		t.Fatalf("exit %d:\n%s%s", code, text, errOut.String())
	}
	f.pg.Exec(t, "ALTER PUBLICATION jetbox SET (publish_via_partition_root = true)")
	out.Reset()
	if code := realMain(args, &out, &errOut); code != exitOK || !strings.Contains(out.String(), `publishes inserts of public.outbox`) {
		t.Fatalf("after the fix: exit %d:\n%s%s", code, out.String(), errOut.String())
	}
}
