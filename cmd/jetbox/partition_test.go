package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/testenv"
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
		t.Fatalf("exit %d:\n%s%s", code, text, plainLog(errOut.String()))
	}
	f.pg.Exec(t, "ALTER PUBLICATION jetbox SET (publish_via_partition_root = true)")
	out.Reset()
	if code := realMain(args, &out, &errOut); code != exitOK || !strings.Contains(out.String(), `publishes inserts of public.outbox`) {
		t.Fatalf("after the fix: exit %d:\n%s%s", code, out.String(), plainLog(errOut.String()))
	}
}

// partitionedOutboxDDL is the README's outbox partitioned by created_at:
// a partition for the past and a default one.
const partitionedOutboxDDL = `CREATE TABLE public.outbox (id uuid NOT NULL DEFAULT gen_random_uuid(), aggregate_type text NOT NULL,
	aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL, headers jsonb,
	created_at timestamptz NOT NULL DEFAULT now()) PARTITION BY RANGE (created_at);
	CREATE TABLE public.outbox_old PARTITION OF public.outbox FOR VALUES FROM ('2000-01-01') TO ('2001-01-01');
	CREATE TABLE public.outbox_all PARTITION OF public.outbox DEFAULT`

// insertAt commits one outbox row per created_at in one transaction and
// returns their ids in insert order.
func (f *fixture) insertAt(conn *pgx.Conn, eventType string, at ...string) []string {
	f.t.Helper()
	rows, err := conn.Query(ctxT(f.t, 30*time.Second), `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
		SELECT 'order', '1', $1, jsonb_build_object('n', n), a::timestamptz FROM unnest($2::text[]) WITH ORDINALITY AS u(a, n) ORDER BY n
		RETURNING id::text`, eventType, at)
	must(f.t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	must(f.t, err)
	return ids
}

// TestPartitionRootTurnedOff: publish_via_partition_root turned off under a
// running jetbox. pgoutput then names the outbox's rows after its leaf
// partitions (one that existed at start, one created after): jetbox reads
// them as outbox rows, warning with the fix, so every row reaches the
// stream once, in order. With the monitor polling, it stops (exit 1) with
// the fix instead of ADD TABLE; rows it had not confirmed are streamed,
// still under the leaves' names, after the fix and a restart. A start with
// the option off is refused (exit 2).
func TestPartitionRootTurnedOff(t *testing.T) {
	f := newFixture(t, withDDL(partitionedOutboxDDL))
	fix := `ALTER PUBLICATION "jetbox" SET (publish_via_partition_root = true)`
	conn := f.conn()
	// No monitor poll after the first: only the decoder sees the change.
	p := f.start("JETBOX_MONITOR_INTERVAL=1h")
	f.waitStreaming(p)
	ids := f.insertAt(conn, "Before", "2000-06-01", "2030-01-01")
	f.waitCount(len(ids), 30*time.Second)

	f.pg.Exec(t, "ALTER PUBLICATION jetbox SET (publish_via_partition_root = false)")
	ids = append(ids, f.insertAt(conn, "Leaf", "2030-01-01", "2000-06-01", "2030-01-02")...)
	f.pg.Exec(t, "CREATE TABLE public.outbox_new PARTITION OF public.outbox FOR VALUES FROM ('2100-01-01') TO ('2200-01-01')")
	ids = append(ids, f.insertAt(conn, "NewLeaf", "2150-01-01", "2000-06-01")...)
	ids = append(ids, f.insertOne(conn, "Last"))
	f.waitCount(len(ids), 30*time.Second)
	f.assertStream(ids)
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
	wantAll(t, "jetbox's log", p.logText(), "public.outbox_all", "public.outbox_new", "publish_via_partition_root", fix)
	p = f.start()
	p.waitExit(exitConfig, "without publish_via_partition_root", fix)
	f.pg.Exec(t, "ALTER PUBLICATION jetbox SET (publish_via_partition_root = true)")

	// The monitor polls: it stops jetbox with the fix.
	accept := "JETBOX_ACCEPT_LOST_ROWS=true" // the publication was altered after the slot's position
	p = f.start("JETBOX_MONITOR_INTERVAL=200ms", accept)
	f.waitStreaming(p)
	ids = append(ids, f.insertOne(conn, "Root"))
	f.waitCount(len(ids), 30*time.Second)
	f.pg.Exec(t, "ALTER PUBLICATION jetbox SET (publish_via_partition_root = false)")
	for range 3 {
		ids = append(ids, f.insertAt(conn, "Leaf2", "2150-01-01", "2030-01-01")...)
	}
	log := p.waitExit(exitFailure, fix)
	if strings.Contains(log, "ADD TABLE") {
		t.Fatalf("the monitor suggests ADD TABLE, which Postgres refuses for a member:\n%s", p.tail(4096))
	}
	f.pg.Exec(t, "ALTER PUBLICATION jetbox SET (publish_via_partition_root = true)")
	p = f.start(accept)
	f.waitStreaming(p)
	ids = append(ids, f.insertOne(conn, "After"))
	f.waitCount(len(ids), 30*time.Second)
	f.assertStream(ids)
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
}

// TestPartitionDroppedBeforeReplay: rows written under a leaf's name
// (publish_via_partition_root off) into a partition that is dropped
// before jetbox reads them (pruning old partitions while jetbox is
// stopped): pgoutput streams them by the catalog of then, and the catalog
// of now places the table nowhere. In a publication of the outbox alone
// they are read as outbox rows, none lost. In one that also publishes
// other tables jetbox cannot tell such a table from another one with the
// outbox's columns, and stops (exit 1) before confirming past the row.
func TestPartitionDroppedBeforeReplay(t *testing.T) {
	for _, shared := range []bool{false, true} {
		t.Run(map[bool]string{false: "publication of the outbox alone", true: "publication with another table"}[shared], func(t *testing.T) {
			f := newFixture(t, withDDL(partitionedOutboxDDL))
			conn := f.conn()
			accept := "JETBOX_ACCEPT_LOST_ROWS=true" // the publication is altered after the slot's position
			p := f.start("JETBOX_MONITOR_INTERVAL=1h")
			f.waitStreaming(p)
			ids := f.insertAt(conn, "Before", "2030-01-01")
			f.waitCount(len(ids), 30*time.Second)
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
			if shared {
				f.pg.Exec(t, "ALTER PUBLICATION jetbox ADD TABLE other")
			}
			// While jetbox is stopped: rows named after outbox_old, which is
			// then dropped, and the option set back.
			f.pg.Exec(t, "ALTER PUBLICATION jetbox SET (publish_via_partition_root = false)")
			old := f.insertAt(conn, "Pruned", "2000-06-01", "2030-01-02", "2000-07-01")
			f.pg.Exec(t, "ALTER TABLE outbox DETACH PARTITION outbox_old")
			f.pg.Exec(t, "DROP TABLE outbox_old")
			f.pg.Exec(t, "ALTER PUBLICATION jetbox SET (publish_via_partition_root = true)")
			p = f.start(accept, "JETBOX_MONITOR_INTERVAL=1h")
			if shared {
				p.waitExit(exitFailure, "is no partition of it now", "SET TABLE public.outbox")
				if lsn, _, err := f.slotState(); err != nil || f.storedIDs() != len(ids) {
					t.Fatalf("after the stop: slot at %s (%v), %d messages, want %d", lsn, err, f.storedIDs(), len(ids))
				}
				// The way out for a dropped partition: the outbox alone.
				f.pg.Exec(t, "ALTER PUBLICATION jetbox SET TABLE outbox")
				p = f.start(accept, "JETBOX_MONITOR_INTERVAL=1h")
			}
			f.waitStreaming(p)
			ids = append(ids, old...)
			ids = append(ids, f.insertOne(conn, "After"))
			f.waitCount(len(ids), 30*time.Second)
			f.assertStream(ids)
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
		})
	}
}

// storedIDs is how many messages the stream holds.
func (f *fixture) storedIDs() int {
	f.t.Helper()
	return len(testenv.ReadStream(f.t, f.js, "OUTBOX", false))
}
